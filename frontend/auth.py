"""API keys at the front door, checked as ``vllm serve --api-key`` checks them (vLLM 0.33's
``AuthenticationMiddleware``): a request under ``/v1`` needs ``Authorization: Bearer KEY`` with one
of the configured keys; ``/health``, ``/ping``, ``/version`` and ``/metrics`` stay open (probes
and scrapers carry no key), and so does every ``OPTIONS`` request. A missing or wrong key is a 401
in OpenAI's error shape, which the ``openai`` client raises as ``AuthenticationError``.

Keys are compared as SHA-256 digests with ``hmac.compare_digest``, so the comparison takes the
same time whatever the key sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

GUARDED_PREFIXES = ("/v1",)

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self.digests = [_digest(k) for k in keys]
        if not self.digests:
            raise ValueError("APIKeyMiddleware needs at least one key")

    def allowed(self, authorization: bytes | None) -> bool:
        if not authorization:
            return False
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        sent = _digest(token.strip())
        ok = False
        for d in self.digests:  # every key compared: the time does not say which one matched
            ok |= hmac.compare_digest(sent, d)
        return ok

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.allowed(auth):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "Unauthorized: send the API key as 'Authorization: Bearer KEY'",
            "type": "authentication_error", "param": None, "code": 401,
            "reason": "unauthorized"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _guarded(scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return path.startswith(GUARDED_PREFIXES)
