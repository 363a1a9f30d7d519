"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
/health, /metrics. Streams are server-sent events ending in ``data: [DONE]``.

A request is validated, tokenized, routed and submitted before the response starts, and its
first token is awaited too: refusals keep their status codes (400 bad parameters, 404 unknown
model, 413 prompt longer than max_model_len or a body above MAX_BODY_BYTES, 503 no worker; an
unknown path or method is a 404/405 in the same OpenAI error shape). A worker lost mid-stream ends the
stream with an error event (``data: {"error": ...}``) and ``[DONE]``. A client that disconnects
cancels the stream (or, not streaming, the collection of the answer), which aborts the request
on the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvpool.frontend.auth import APIKeyMiddleware
from kvpool.frontend.body import BODY_TIMEOUT_S, read_json
from kvpool.frontend.errors import RETRY_AFTER_S, APIError, WorkerLost
from kvpool.frontend.generation import Delta
from kvpool.frontend.params import GenRequest, parse_request
from kvpool.frontend.responses import ResponseBuilder, usage
from kvpool.frontend.run import Forward, Run
from kvpool.frontend.service import FrontDoor
from kvpool.frontend.tokenize_api import add_utility_routes
from kvpool.shared.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _lost(e: WorkerLost) -> APIError:
    return APIError(503, f"{e}; the request was not finished: retry it", None, "worker_lost")


def create_app(fd: FrontDoor, *, api_keys: tuple[str, ...] = (), body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await fd.start()
        try:
            yield
        finally:
            await fd.close()

    app = FastAPI(title="kvpool front door", lifespan=lifespan)
    app.state.frontdoor = fd
    app.state.body_timeout_s = body_timeout_s
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Routing errors (404 no such path, 405 wrong method) in OpenAI's error shape too."""
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None,
                                     "not_found" if e.status_code == 404 else str(e.status_code)).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        d = fd.directory
        serving = [w for m in d.models() for w in d.serving(m)]
        held = {w.name: why for w in serving if (why := d.unavailable(w)) is not None}  # drain, lost manager
        n = len(serving) - len(held)
        lost = {w.name: w.link.lost for w in d.workers.values() if w.link.lost is not None}
        body = {"status": "ok" if n else (next(iter(held.values())) if held else "no workers"), "workers": n,
                **({"unreachable": lost} if lost else {}), **({"unavailable": held} if held else {})}
        return JSONResponse(body, status_code=200 if n else 503)  # unreachable: each known worker's reason

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        running = {w.name: w.link.running for w in fd.directory.workers.values()}
        return PlainTextResponse(fd.metrics.render(fd.router, running), media_type=CONTENT_TYPE)

    add_utility_routes(app, fd)

    @app.get("/v1/models")
    async def models() -> dict:
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "kvpool",
             "max_model_len": min(w.max_model_len for w in ws), "workers": len(ws)}
            for m, ws in sorted(fd.directory.models().items())] + [
            {"id": m, "object": "model", "created": now, "owned_by": "vllm", "servers": len(es)}
            for m, es in sorted(fd.directory.external_models().items()) if m not in fd.directory.models()]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(fd, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(fd, request, chat=True)

    return app


async def _generate(fd: FrontDoor, request: Request, chat: bool):
    endpoint = "chat" if chat else "completions"
    try:
        raw = await read_json(request, request.app.state.body_timeout_s)
        if type(raw) is dict and fd.proxy.serves(raw.get("model")):  # attached vLLM servers serve it
            reply = await fd.proxy.forward(raw, chat)
            fd.metrics.finished(endpoint, str(reply.status_code))
            return reply
        req = parse_request(raw, chat)
        run = await fd.start_run(req)
        if isinstance(run, Forward):  # a mixed fleet's vLLM server took it: the body goes there as it came
            reply = await _forward(fd, run, req, raw, chat)
            if isinstance(reply, Response):
                fd.metrics.finished(endpoint, str(reply.status_code))
                return reply
            run = reply  # routed again, to a worker
    except ClientDisconnect:  # the client left before its whole body arrived: nothing started
        fd.metrics.finished(endpoint, "disconnected")
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    except APIError as e:
        fd.metrics.finished(endpoint, str(e.status))
        raise
    events = run.events()
    try:
        first: Delta | None = await anext(events, None)
    except (APIError, WorkerLost) as e:
        await _end(fd, run, events, endpoint, "error")
        raise _lost(e) if isinstance(e, WorkerLost) else e from None
    builder = ResponseBuilder(chat, req.model, req.logprobs is not None, req.return_token_ids)
    headers = {"x-kvpool-worker": ",".join(r.decision.worker.name for r in run.runs)}  # where it was routed
    if req.stream:
        return StreamingResponse(_stream(fd, run, events, first, builder, endpoint), media_type="text/event-stream",
                                 headers=headers)
    deltas = [first] if first is not None else []
    try:
        rest = await _collect(events, request)
    except (APIError, WorkerLost) as e:
        await _end(fd, run, events, endpoint, "error")
        raise _lost(e) if isinstance(e, WorkerLost) else e from None
    if rest is None:  # the client went away: the request was aborted on the worker
        await _end(fd, run, events, endpoint, "disconnected")
        return JSONResponse({}, status_code=499)
    deltas += rest
    await _end(fd, run, events, endpoint, "200")
    body = builder.whole(deltas, len(run.runs) * req.n, _usage(run))
    return JSONResponse(body, headers=headers)


async def _collect(events: AsyncIterator[Delta], request: Request) -> list[Delta] | None:
    """Every remaining delta; None when the client disconnected first (the generation is then
    cancelled, which aborts it on the worker): the non-streaming twin of a cancelled stream."""
    task = asyncio.ensure_future(_drain(events))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


async def _drain(events: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in events]


async def _forward(fd: FrontDoor, fwd: Forward, req: GenRequest, raw: dict, chat: bool) -> Response | Run:
    """Sends a mixed fleet's request to the vLLM server chosen for it; one that refuses the
    connection is taken out and the request routed again: the reply, or the run on a worker."""
    for _ in range(3):
        try:
            return await fd.proxy.send(fwd.decision, raw, chat, fwd.chain)
        except httpx.ConnectError as e:
            fd.proxy.failed(fwd.decision.worker, e)  # type: ignore[arg-type]
        again = await fd.start_run(req)
        if not isinstance(again, Forward):
            return again
        fwd = again
    raise APIError(503, f"no server of {req.model!r} answered; retry shortly", None, "no_worker", RETRY_AFTER_S)


def _usage(run: Run) -> dict:
    return usage(run.prompt_tokens, run.completion_tokens, run.cached_tokens)


async def _end(fd: FrontDoor, run: Run, events: AsyncIterator[Delta], endpoint: str, status: str) -> None:
    await events.aclose()  # type: ignore[attr-defined]  (aborts what is still running)
    fd.release(run)
    fd.metrics.finished(endpoint, status, run.timing)


async def _stream(fd: FrontDoor, run: Run, events: AsyncIterator[Delta], first: Delta | None,
                  builder: ResponseBuilder, endpoint: str) -> AsyncIterator[str]:
    status = "disconnected"  # unless the stream ends normally or with an error event
    try:
        if builder.chat:
            for i in range(len(run.runs) * run.req.n):
                yield _sse(builder.role_chunk(i))
        if first is not None:
            yield _sse(builder.chunk(first))
        try:
            async for d in events:
                yield _sse(builder.chunk(d))
            if run.req.include_usage:
                yield _sse(builder.usage_chunk(_usage(run)))
            status = "200"
        except (APIError, WorkerLost) as e:
            status = "error"
            yield _sse((_lost(e) if isinstance(e, WorkerLost) else e).body())
        except Exception as e:  # a bug: the client still gets a clean end
            logger.exception("stream failed")
            status = "error"
            yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        yield _sse("[DONE]")
    finally:
        await _end(fd, run, events, endpoint, status)
