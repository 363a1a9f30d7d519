"""Bounded msgpack decoding: msgpack's own length limits plus a cap on maps and arrays in all.

Both sockets anyone may reach (the manager's request socket, the worker's generate socket) decode
with this, so a bomb of millions of empty maps, or deep nesting, is refused after building at most
``max_objects`` containers, counted as they are built, rather than after building them all.
"""

from __future__ import annotations

from typing import Any

import msgpack


class TooComplex(ValueError):
    """A payload holds more maps and arrays than any request needs (refused while decoding)."""


def unpack_counted(payload: bytes, max_objects: int, message: str, **limits: int) -> Any:
    """Decodes ``payload`` with msgpack's ``limits`` (``max_array_len=...`` and friends), raising
    ``TooComplex(message)`` once more than ``max_objects`` maps and arrays have been built."""
    left = [max_objects]

    def count(obj: Any) -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise TooComplex(message)
        return obj

    return msgpack.unpackb(payload, raw=False, strict_map_key=True, object_hook=count, list_hook=count, **limits)
