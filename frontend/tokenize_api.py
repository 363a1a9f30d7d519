"""The utility endpoints a vLLM client reaches for beside the OpenAI API, in vLLM 0.33's shapes:

- ``GET|POST /ping``: 200 while a worker is reachable, 503 otherwise (as ``/health``);
- ``GET /version``: ``{"version": kvpool's version}``;
- ``POST /tokenize``: ``{"model", "prompt"}`` (``add_special_tokens``, default true) or
  ``{"model", "messages"}`` (the chat template applied; ``add_generation_prompt``, default true)
  -> ``{"count", "max_model_len", "tokens", "token_strs"}`` (``return_token_strs`` asks for the
  strings);
- ``POST /detokenize``: ``{"model", "tokens"}`` -> ``{"prompt": text}``.

``model`` may be left out while the front door serves exactly one model. Tokenizing runs off the
event loop, so a large prompt does not stall other requests.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.frontend.body import read_json
from kvpool.frontend.chat_template import TemplateError
from kvpool.frontend.errors import APIError, bad_param
from kvpool.frontend.params import chat_messages
from kvpool.frontend.service import FrontDoor
from kvpool.frontend.tokenizer import Tokenizer


def kvpool_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:
        return "unknown"


def add_utility_routes(app: FastAPI, fd: FrontDoor, body_timeout_s: float) -> None:
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        serving = any(fd.directory.serving(m) for m in fd.directory.models())
        return Response(status_code=200 if serving else 503)

    @app.get("/version")
    async def kv_version() -> dict:
        return {"version": kvpool_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _object(request, body_timeout_s)
        model, tok, max_len = _model(fd, body)
        if "messages" in body:
            messages = chat_messages(body)
            try:
                text = await asyncio.to_thread(tok.apply_chat_template, messages,
                                               _flag(body, "add_generation_prompt", True))
            except (TemplateError, ValueError) as e:
                raise bad_param("messages", str(e)) from None
            ids = await asyncio.to_thread(tok.encode, text, _flag(body, "add_special_tokens", False))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_param("prompt", "prompt must be a string (or send messages)")
            ids = await asyncio.to_thread(tok.encode, prompt, _flag(body, "add_special_tokens", True))
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] \
            if _flag(body, "return_token_strs", False) else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await _object(request, body_timeout_s)
        _, tok, _ = _model(fd, body)
        ids = body.get("tokens")
        if type(ids) is not list or not all(type(t) is int and 0 <= t < tok.vocab_size for t in ids):
            raise bad_param("tokens", f"tokens must be a list of token ids below the vocabulary size {tok.vocab_size}")
        return JSONResponse({"prompt": await asyncio.to_thread(tok.decode, ids)})


async def _object(request: Request, body_timeout_s: float) -> dict:
    body = await read_json(request, body_timeout_s)
    if type(body) is not dict:
        raise bad_param("body", "the request body must be a JSON object")
    return body


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if type(v) is not bool:
        raise bad_param(key, f"{key} must be true or false")
    return v


def _model(fd: FrontDoor, body: dict) -> tuple[str, Tokenizer, int]:
    """(model, its tokenizer, its max_model_len) of the request's ``model`` or the only one served."""
    known = fd.directory.models()
    model = body.get("model")
    if model is None and len(known) == 1:
        model = next(iter(known))
    if not isinstance(model, str) or model not in known:
        raise APIError(404, f"the model {model!r} does not exist; served models: {sorted(known)}", "model",
                       "model_not_found")
    return model, fd.tokenizer(model), min(w.max_model_len for w in known[model])
