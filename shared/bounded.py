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


class DuplicateKey(ValueError):
    """A map repeats a key: msgpack would keep the last value; a request is refused instead."""


def map_header_len(payload: bytes) -> int | None:
    """The entry count of the msgpack map that ``payload`` starts with (None: not a map)."""
    if not payload:
        return None
    b = payload[0]
    if 0x80 <= b <= 0x8F:
        return b & 0x0F
    if b == 0xDE and len(payload) >= 3:
        return int.from_bytes(payload[1:3], "big")
    if b == 0xDF and len(payload) >= 5:
        return int.from_bytes(payload[1:5], "big")
    return None


def check_envelope_keys(payload: bytes, msg: Any) -> None:
    """DuplicateKey unless the decoded top-level map has as many keys as its header declares: a
    repeated key of the message itself, read from the header for free (no per-map hook)."""
    if type(msg) is dict and map_header_len(payload) != len(msg):
        raise DuplicateKey(f"the message map declares {map_header_len(payload)} entries but has {len(msg)} "
                           "distinct keys: a key is repeated")


def _unique(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"a map repeats the key {str(dup)[:40]!r}")
    return d


def unpack_counted(payload: bytes, max_objects: int, message: str, *, unique_keys: bool = False,
                   **limits: int) -> Any:
    """Decodes ``payload`` with msgpack's ``limits`` (``max_array_len=...`` and friends), raising
    ``TooComplex(message)`` once more than ``max_objects`` maps and arrays have been built, and
    with ``unique_keys`` ``DuplicateKey`` for any map that repeats a key (a hook per map: for
    messages of a few maps, not a step of hundreds)."""
    left = [max_objects]

    def count(obj: Any) -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise TooComplex(message)
        return obj

    if unique_keys:
        def pairs(p: list) -> dict:
            return count(_unique(p))

        return msgpack.unpackb(payload, raw=False, strict_map_key=True, object_pairs_hook=pairs, list_hook=count,
                               **limits)
    return msgpack.unpackb(payload, raw=False, strict_map_key=True, object_hook=count, list_hook=count, **limits)
