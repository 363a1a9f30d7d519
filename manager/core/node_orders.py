"""The node tier's copy orders: what a worker copies between its pool and the node's levels.

Pure records, no I/O. The node tier (manager/core/node_tier.py) hands them out; a worker runs
them (worker/node_store.py holds the bytes). Every order names the block hash it moves (``key``):
the writer records it beside the bytes and their checksum, and the reader compares both before
a block is used, so an order that reaches a recycled or torn slot is a verify failure, never
wrong K/V served.

  * ``Save(to="host")``: the pool's device block ``src`` -> node host slot ``dst``;
  * ``Save(to="disk")``: node host slot ``src`` -> disk slot ``dst`` (a write-down; the worker
    reads the host slot verified, like any load, so a torn host block is never written down
    as whole: it reports the write-down failed);
  * ``Load(frm="host")``: node host slot ``src`` -> the pool's device block ``dst``;
  * ``Load(frm="disk")``: disk slot ``src`` -> node host slot ``dst`` (a prefetch: the block
    is loaded to the device by a later step, once it landed in host memory).

On the wire each is a map ``{op, level, src, dst, key}`` (``op`` "save" or "load"; ``level`` the
destination of a save, the source of a load); ``order_from_wire`` validates one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.shared.hashing import HASH_BYTES
from kvpool.shared.protocol import bad_field

LEVELS = ("host", "disk")  # the node tier's levels, fastest first
MAX_SLOT = (1 << 40) - 1


@dataclass(frozen=True, slots=True)
class Save:
    """A copy down: device -> host (``to="host"``) or host -> disk (``to="disk"``)."""

    to: str
    src: int
    dst: int
    key: bytes

    def to_wire(self) -> dict:
        return {"op": "save", "level": self.to, "src": self.src, "dst": self.dst, "key": self.key}


@dataclass(frozen=True, slots=True)
class Load:
    """A copy up: host -> device (``frm="host"``) or disk -> host (``frm="disk"``)."""

    frm: str
    src: int
    dst: int
    key: bytes

    def to_wire(self) -> dict:
        return {"op": "load", "level": self.frm, "src": self.src, "dst": self.dst, "key": self.key}


Order = Save | Load


def order_from_wire(m: object) -> Order:
    """The order a wire map describes; ``bad_field`` naming the first wrong field otherwise."""
    if type(m) is not dict:
        raise bad_field("order", "a map {op, level, src, dst, key}", m)
    op, level, key = m.get("op"), m.get("level"), m.get("key")
    if op not in ("save", "load"):
        raise bad_field("order.op", "'save' or 'load'", op)
    if level not in LEVELS:
        raise bad_field("order.level", f"one of {LEVELS}", level)
    for field in ("src", "dst"):
        v = m.get(field)
        if type(v) is not int or not 0 < v <= MAX_SLOT:
            raise bad_field(f"order.{field}", f"an int in [1, {MAX_SLOT}]", v)
    if type(key) is not bytes or len(key) != HASH_BYTES:
        raise bad_field("order.key", f"a {HASH_BYTES}-byte bin", key)
    cls = Save if op == "save" else Load
    return cls(level, m["src"], m["dst"], key)
