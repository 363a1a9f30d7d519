"""One HTTP request's prompt runs on kvpool workers, and the routing helper they share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from kvpool.frontend.generation import Delta, PromptRun, Timing
from kvpool.frontend.params import GenRequest
from kvpool.frontend.router import Decision


@dataclass(frozen=True)
class Forward:
    """A request the router gave to an attached vLLM server (a mixed fleet): its body goes there
    unchanged (frontend/vllm_proxy.py ``send``)."""

    decision: Decision
    chain: list[bytes]  # the prompt's hash chain in the server's block size


def leading_in(chain: list[bytes], held: Mapping[bytes, int] | None) -> int:
    """How many leading hashes of ``chain`` are in ``held`` (a hash names its whole prefix)."""
    if not held:
        return 0
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


class Run:
    """The prompt runs of one HTTP request; ``events`` merges their deltas."""

    def __init__(self, req: GenRequest, runs: list[PromptRun], prompt_tokens: int, timing: Timing) -> None:
        self.req, self.runs, self.prompt_tokens, self.timing = req, runs, prompt_tokens, timing

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.runs)

    @property
    def cached_tokens(self) -> int:
        return sum(r.decision.hit_blocks * r.decision.worker.block_size for r in self.runs)

    async def events(self) -> AsyncIterator[Delta]:
        if len(self.runs) == 1:
            async for d in self.runs[0].deltas():
                yield d
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(run: PromptRun) -> None:
            try:
                async for d in run.deltas():
                    q.put_nowait(d)
                q.put_nowait(None)
            except Exception as e:  # noqa: BLE001 (handed to the consumer)
                q.put_nowait(e)

        tasks = [asyncio.create_task(pump(r)) for r in self.runs]
        try:
            left = len(tasks)
            while left:
                item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
