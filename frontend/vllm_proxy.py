"""OpenAI requests for a model that attached vLLM servers serve: routed by prefix, then proxied.

The managers mirror each attached server's cache (manager/external/); the front door learns the
servers from their ``externals`` op (frontend/directory.py). For a request of such a model:

1. its prompt tokens come from a server's own ``/tokenize`` (its tokenizer and chat template:
   the tokens it will compute, so the hashes match what its events report), or for a completion
   from the servers' tokenizer in this process when `kvpool serve --tokenizer MODEL=PATH` names it;
2. kvpool's hash chain of the full blocks is located at the managers (``locate``'s
   ``external``: the leading blocks each server holds; a stale mirror claims none);
3. the router's cost (frontend/router.py) picks the server, with the load this front door has
   sent it and not yet seen finish;
4. the request is sent there with its body unchanged, and the reply comes back as vLLM wrote it
   (status, JSON or the SSE stream).

A server that refuses the connection is taken out for ``TAKE_OUT_S`` and the request goes to the
next one; one that stops mid-stream (nothing for ``silence_s``, or the connection breaks) ends
the client's stream with an error event and ``[DONE]``, never a hang. A request for a model that
kvpool workers serve never comes here: mixed fleets are not routed together yet.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from kvpool.frontend.directory import Directory, External, Located
from kvpool.frontend.errors import RETRY_AFTER_S, APIError
from kvpool.frontend.external_load import ExternalLoad, Sent
from kvpool.frontend.router import Candidate, Decision, KVRouter
from kvpool.frontend.tokenizer import Tokenizer
from kvpool.shared.hashing import hash_blocks

logger = logging.getLogger(__name__)
TAKE_OUT_S = 10.0  # a server that refused a connection gets no request for this long (unless all did)


def max_tokens_of(body: dict) -> int:
    v = body.get("max_tokens", body.get("max_completion_tokens"))
    return v if type(v) is int and v > 0 else 16


class VLLMProxy:
    def __init__(self, directory: Directory, router: KVRouter, silence_s: float = 30.0,
                 local_tokenizer: Callable[[str], Tokenizer | None] = lambda model: None) -> None:
        """``local_tokenizer``: the tokenizer of a model this process may use itself (`kvpool serve
        --tokenizer MODEL=PATH`, the servers' checkpoint), saving a completion its /tokenize call."""
        self.directory, self.router, self.local_tokenizer = directory, router, local_tokenizer
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=silence_s, write=30.0, pool=30.0))
        self.load = ExternalLoad()  # what this door sent each server, and their own load

    def serves(self, model: object) -> bool:
        return (isinstance(model, str) and model in self.directory.external_models()
                and model not in self.directory.models())

    def servers(self, model: str, tried: set[tuple[int, str]] = frozenset()) -> list[External]:
        """The servers of ``model`` that may take a request now: those not taken out, else (all
        taken out) every one not tried yet."""
        now = time.monotonic()
        known = [s for s in self.directory.external_models().get(model, []) if s.key not in tried]
        return [s for s in known if now - s.failed_at > TAKE_OUT_S] or known

    async def close(self) -> None:
        await self.http.aclose()

    async def forward(self, body: dict, chat: bool) -> Response:
        servers = self.directory.external_models()[body["model"]]
        tried: set[tuple[int, str]] = set()
        while True:
            pool = self.servers(body["model"], tried)
            if not pool:
                raise APIError(503, f"no server of {body['model']!r} answered: "
                                    f"{', '.join(s.url for s in servers)}; retry shortly", None, "no_worker",
                               RETRY_AFTER_S)
            try:
                d, chain = await self._choose(pool, body, chat)
            except httpx.TransportError as e:  # its /tokenize did not answer: take it out, try another
                bad = pool[0]
                self.failed(bad, e)
                tried.add(bad.key)
                continue
            try:
                return await self.send(d, body, chat, chain)
            except httpx.ConnectError as e:  # nothing reached it: the next server takes the request
                self.failed(d.worker, e)  # type: ignore[arg-type]  (send takes only servers)
                tried.add(d.worker.key)

    def failed(self, s: External, e: Exception) -> None:
        logger.warning("external server %s (%s) failed: %s; taken out for %.0f s", s.name, s.url, e, TAKE_OUT_S)
        s.take_out(time.monotonic())

    async def _tokenize(self, s: External, body: dict, chat: bool) -> list[int]:
        if chat:
            ask = {"model": body["model"], "messages": body.get("messages"),
                   "add_generation_prompt": body.get("add_generation_prompt", True)}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt  # token ids already
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]  # a batch: routed by its first prompt
            if not isinstance(prompt, str):
                return []  # the server will say what is wrong with it
            tok = self.local_tokenizer(body["model"])
            if tok is not None and body.get("add_special_tokens", True) is True:
                try:
                    return tok.encode(prompt, add_special_tokens=True)  # as vLLM's completions encode it
                except ValueError:
                    return []  # (a lone surrogate: the server answers it)
            ask = {"model": body["model"], "prompt": prompt}
        r = await self.http.post(s.url + "/tokenize", json=ask)
        if r.status_code != 200:
            return []  # a bad request: the server answers it, routed by load alone
        return r.json().get("tokens") or []

    async def _choose(self, servers: list[External], body: dict, chat: bool) -> tuple[Decision, list[bytes]]:
        # only the kv-aware policy looks at caches: the others need no tokens
        ids = await self._tokenize(servers[0], body, chat) if self.router.needs_locate else []
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        chains: dict[int, list[bytes]] = {}
        located: dict[tuple[int, int], Located] = {}
        if self.router.needs_locate and ids:
            for bs in sorted({s.block_size for s in servers}):
                full = (len(ids) - 1) // bs  # the block of the last prompt token is always recomputed
                if full > 0:
                    chains[bs] = hash_blocks(ids[: full * bs], bs, cache_salt=salt)
            for m, bs in sorted({(s.manager, s.block_size) for s in servers if s.block_size in chains}):
                located[(m, bs)] = await self.directory.locate_all(m, chains[bs])
        cands = self.candidates(servers, located, chains, len(ids), max_tokens_of(body))
        d = self.router.choose(cands, max(0, (len(ids) - 1) // servers[0].block_size))
        return d, chains.get(d.worker.block_size, [])

    def candidates(self, servers: list[External], located: dict[tuple[int, int], Located],
                   chains: dict[int, list[bytes]], prompt_len: int, max_tokens: int) -> list[Candidate]:
        """One candidate per server (the router's cost: frontend/router.py), from the managers'
        ``locate`` answers per (manager, block size) and the prompt's chain in each block size."""
        out = []
        for s in servers:
            where = located.get((s.manager, s.block_size)) or Located()
            chain = chains.get(s.block_size, [])
            hit, host = where.external.get(s.name, 0), where.external_cpu.get(s.name, 0)
            full = max(0, (prompt_len - 1) // s.block_size)
            out.append(self.load.candidate(s, hit, host, chain, full, 1 + max_tokens / s.block_size))
        return out

    async def send(self, d: Decision, body: dict, chat: bool, chain: list[bytes]) -> Response:
        """Sends ``body`` to the decided server, counted in its load until the answer ends."""
        s = d.worker
        if not isinstance(s, External):
            raise TypeError(f"send: {s.name} is a kvpool worker, not an attached server")
        path = "/v1/chat/completions" if chat else "/v1/completions"
        decode = max_tokens_of(body) / s.block_size
        sent = self.load.start(s.key, max(0.0, len(chain) - d.expected_blocks), decode, 1 + decode, chain)
        return await self._send(s, path, body, sent)

    async def _send(self, s: External, path: str, body: dict, sent: Sent) -> Response:
        headers = {"x-kvpool-worker": s.name}

        def release() -> None:
            self.load.finish(sent)

        try:
            req = self.http.build_request("POST", s.url + path, json=body)
            resp = await self.http.send(req, stream=True)
        except BaseException:
            release()
            raise
        kind = resp.headers.get("content-type", "application/json")
        if not kind.startswith("text/event-stream"):  # a whole answer (or vLLM's error)
            try:
                content = await resp.aread()
            except httpx.TransportError as e:
                raise APIError(502, f"the server {s.name} broke off its answer: {e}", None, "worker_lost") from None
            finally:
                await resp.aclose()
                release()
            return Response(content, status_code=resp.status_code, media_type=kind, headers=headers)
        return StreamingResponse(self._relay(s, resp, sent, release), status_code=resp.status_code,
                                 media_type=kind, headers=headers)

    async def _relay(self, s: External, resp: httpx.Response, sent: Sent, release) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                self.load.first_token(sent)  # (its first event: the prompt is computed)
                yield chunk
        except httpx.TransportError as e:  # the server died or went silent mid-stream
            logger.warning("external server %s broke off a stream: %r", s.name, e)
            s.take_out(time.monotonic())
            err = APIError(503, f"the server {s.name} stopped answering mid-stream ({type(e).__name__}); "
                                "retry the request", None, "worker_lost", RETRY_AFTER_S)
            yield b"\n\ndata: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await resp.aclose()
            release()
