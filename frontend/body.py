"""Reading a request's JSON body at the front door: bounded in size and in time, and valid text.

Three refusals, each before any work is done on the body:
- a body above ``MAX_BODY_BYTES`` (413): a declared length above it before a byte is read, a
  chunked body as soon as it passes it (never buffered whole);
- a body that does not arrive within ``timeout_s`` (408): a client that trickles bytes holds a
  connection no longer than that;
- a body that is not JSON, or whose strings are not valid Unicode (400): raw bytes that are no
  UTF-8 (``ED A0 80``, a UTF-16 surrogate written as UTF-8) and lone surrogate escapes
  (``"\\ud800"``) decode to Python strings that no tokenizer or JSON encoder can take, so they
  are refused here, with the field named, instead of failing deep inside.
"""

from __future__ import annotations

import asyncio
import json
import re

from starlette.requests import Request

from kvpool.frontend.errors import APIError, bad_param
from kvpool.frontend.tokenizer import check_unicode

MAX_BODY_BYTES = 16 << 20
BODY_TIMEOUT_S = 30.0
# A \uD800-\uDFFF escape: the only way valid UTF-8 JSON can carry a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def too_large(size: str) -> APIError:
    return APIError(413, f"the request body has {size} bytes; at most {MAX_BODY_BYTES}", None, "too_large")


async def read_json(request: Request, timeout_s: float = BODY_TIMEOUT_S) -> object:
    """The request's JSON body, or an APIError (413, 408 or 400) that says what is wrong."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large(declared)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _read(request)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", None, "body_timeout") from None
    try:
        text = raw.decode("utf-8-sig")  # strict; a leading BOM is dropped
    except UnicodeDecodeError as e:
        raise bad_param("body", f"the body is not valid UTF-8 (byte {e.start}): {e.reason}") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise bad_param("body", f"the body is not valid JSON: {e}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise bad_param("body", "the body's JSON is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        check_text(body, "body")
    return body


async def _read(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large(f"more than {size}")
        chunks.append(chunk)
    return b"".join(chunks)


def check_text(value: object, where: str) -> None:
    """Every string in ``value`` (keys too) is valid Unicode; else a 400 naming where (JSON decodes
    a lone surrogate escape into a string that UTF-8 cannot encode)."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                raise bad_param(_param(at), f"{at} holds a lone UTF-16 surrogate: not valid Unicode text")
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _encodable(k):
                    raise bad_param(_param(at), f"a key in {at} holds a lone UTF-16 surrogate")
                stack.append((item, f"{k}" if at == "body" else f"{at}.{k}"))
        elif isinstance(v, list):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v) if isinstance(item, str | dict | list))


def _encodable(s: str) -> bool:
    try:
        check_unicode(s)
    except ValueError:
        return False
    return True


def _param(at: str) -> str:
    """The top-level parameter a path names (``messages[0].content`` -> ``messages``)."""
    return re.split(r"[.\[]", at, maxsplit=1)[0]
