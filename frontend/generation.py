"""One prompt's run on one worker: token messages -> text deltas per choice.

Text is released through the incremental detokenizer; with ``stop`` strings the last
``len(longest stop) - 1`` characters are held back until they cannot begin a stop string, and a
choice that meets one ends there (finish reason ``stop``; the stop string is not returned, as in
OpenAI's API). When every choice has ended, or the consumer goes away (client disconnect), the
request is aborted on the worker so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvpool.client.generate_core import MANAGER_GRACE_S, Outage
from kvpool.frontend.detokenizer import IncrementalDetokenizer
from kvpool.frontend.errors import RETRY_AFTER_S, UNAVAILABLE, APIError, unavailable
from kvpool.frontend.router import Decision
from kvpool.frontend.tokenizer import Tokenizer
from kvpool.shared.generate import ErrorMessage, Heartbeat, TokenMessage


@dataclass
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]


@dataclass
class Delta:
    index: int  # the choice's index in the response
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the tokens this delta covers (return_token_ids)
    # vLLM's stop_reason: the stop string or stop_token_ids entry that ended the choice (None: eos, length)
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None  # on the first delta of each choice


@dataclass
class Choice:
    index: int
    detok: IncrementalDetokenizer
    text: str = ""  # released
    held: str = ""  # decoded, not released yet (may begin a stop string)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    ids: list[int] = field(default_factory=list)  # tokens received, not yet in a delta
    started: bool = False  # a delta of it went out (the first one carries the prompt's ids)


@dataclass
class Timing:
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now


def cut_at_stop(pending: str, stops: list[str], final: bool) -> tuple[str, bool, str]:
    """(text to release, a stop string was met, text still held)."""
    hits = [p for s in stops if (p := pending.find(s)) >= 0]
    if hits:
        return pending[: min(hits)], True, ""
    keep = 0 if final or not stops else max(len(s) for s in stops) - 1
    cut = max(len(pending) - keep, 0)
    return pending[:cut], False, pending[cut:]


class PromptRun:
    def __init__(self, tokenizer: Tokenizer, prompt: list[int], decision: Decision, *, n: int, first_index: int,
                 stops: list[str], params: dict, cache_salt: str | None, timing: Timing,
                 token_ids_in_logprobs: bool = False, silence_s: float = 30.0,
                 manager_grace_s: float = MANAGER_GRACE_S) -> None:
        """``silence_s``: the longest wait for a message of this request (the worker sends a
        heartbeat every second): past it the request fails, is aborted on the worker and its load
        forgotten, whatever happened to its messages. ``manager_grace_s``: how long the worker
        may report its manager unreachable before a request not yet generating gets its 503."""
        self.tok, self.prompt, self.decision = tokenizer, prompt, decision
        self.stops, self.params, self.cache_salt, self.timing = stops, params, cache_salt, timing
        self.choices = [Choice(first_index + i, IncrementalDetokenizer(tokenizer, prompt)) for i in range(n)]
        self.want_logprobs = params.get("logprobs") is not None
        self.token_ids_in_logprobs = token_ids_in_logprobs
        self.silence_s = silence_s
        self.manager = Outage(manager_grace_s)

    def _held(self, waiting: str | None) -> bool:
        """Whether a heartbeat's ``waiting`` means the request cannot move: a drain at once, a
        lost manager once the worker has reported it for ``manager_grace_s`` (one manager call
        that timed out on a loaded machine is no outage: the worker retries it)."""
        if waiting != "manager_unreachable":
            self.manager.up()
            return waiting in UNAVAILABLE
        return self.manager.down(time.monotonic()) is not None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def outstanding_blocks(self) -> float:
        """Work the worker still has for this run, in blocks (frontend/router.py's cost)."""
        d = self.decision
        bs = d.worker.block_size
        max_tokens = self.params.get("max_tokens", 16)
        decode = sum(max_tokens - c.tokens for c in self.choices if c.finish_reason is None) / bs
        if self.timing.first is None:
            return max(len(self.prompt) // bs - d.expected_blocks, 0) + decode
        return decode

    async def deltas(self) -> AsyncIterator[Delta]:
        link = self.decision.worker.link
        rid = link.submit(self.prompt, self.params, self.cache_salt)
        try:
            while any(c.finish_reason is None for c in self.choices):
                try:  # asyncio.timeout, not wait_for: wait_for may swallow a cancellation (client gone)
                    async with asyncio.timeout(self.silence_s):
                        msg = await link.next(rid)
                except TimeoutError:
                    raise APIError(503, f"worker {self.decision.worker.name} sent nothing for this request in "
                                        f"{self.silence_s:g} s: it was aborted; retry it", None, "silent",
                                   RETRY_AFTER_S) from None
                if isinstance(msg, ErrorMessage):
                    raise APIError(400, f"the worker refused the request: {msg.error}", None, "worker_refused")
                if isinstance(msg, Heartbeat):
                    # queued behind a drain or a lost manager, nothing generated yet: say so now (503)
                    # instead of holding the client; a request already generating keeps going
                    if self._held(msg.waiting) and self.completion_tokens == 0:
                        raise unavailable(msg.waiting, f" (worker {self.decision.worker.name})")
                    continue
                if not isinstance(msg, TokenMessage):
                    continue
                delta = self._apply(msg)
                if delta is not None:
                    yield delta
        finally:
            link.abort(rid) if any(c.finish_reason is None for c in self.choices) else link.done(rid)

    def _apply(self, msg: TokenMessage) -> Delta | None:
        index = msg.index
        if type(index) is not int or not 0 <= index < len(self.choices):
            return None
        c = self.choices[index]
        if c.finish_reason is not None:
            return None  # ended by a stop string; the worker had not seen it
        tok, finished = msg.token, msg.finished
        text, lps = "", []
        if tok is not None:
            c.tokens += 1
            c.ids.append(tok)
            self.timing.token()
            text = c.detok.add(tok)
            if self.want_logprobs and msg.logprob is not None:
                top = [(t, self._token_text(t), lp) for t, lp in msg.top_logprobs or []]
                lps.append(TokenLogprob(tok, self._token_text(tok), msg.logprob, top))
        if finished:
            text += c.detok.flush()
        held = c.held + text
        out, stopped, c.held = cut_at_stop(held, self.stops, finished)
        c.text += out
        if stopped:
            c.finish_reason = "stop"
            c.stop_reason = min((s for s in self.stops if s in held), key=held.find)  # the first one met
        elif finished:
            c.finish_reason = self._reason(msg.reason)
            if c.finish_reason == "stop" and tok in self.params.get("stop_token_ids", ()):
                c.stop_reason = tok  # a stop id, not an eos
        if tok is None and not lps and c.finish_reason is None:
            return None  # a token message without a token (none of ours today): nothing to tell
        # one delta per token, its text empty while the detokenizer or a stop string holds it back,
        # as vLLM streams (its completion and chat servers send a chunk for every token once one
        # has come): a client timing its chunks sees each token when it was drawn
        delta = Delta(c.index, out, lps, c.finish_reason, c.ids, c.stop_reason,
                      None if c.started else list(self.prompt))
        c.ids, c.started = [], True
        return delta

    def _token_text(self, token: int) -> str:
        return f"token_id:{token}" if self.token_ids_in_logprobs else self.tok.decode([token])

    @staticmethod
    def _reason(reason: object) -> str:
        if reason in ("stop", "length"):
            return reason  # type: ignore[return-value]
        raise APIError(503, f"the worker ended the request early: {reason}", None, "worker_ended")
