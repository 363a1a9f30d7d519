"""The node tier's copy orders: what a worker copies between its pool and the node's levels, and
the records that carry them in a step's result (``NodeOrders``) and back (``NodeReport``).

Pure records, no I/O. The node tier (manager/core/node_tier.py) hands them out; a worker runs
them (worker/node_store.py holds the bytes). Every order names the block hash it moves (``key``):
the writer records it beside the bytes and their checksum, and the reader compares both before
a block is used, so an order that reaches a recycled or torn slot is a verify failure, never
wrong K/V served.

  * ``Save(to="host")``: the pool's device block ``src`` -> node host slot ``dst``; with
    ``source="private"``, block ``src`` of the pool's *private* host tier instead (a block that
    tier is handing out again moves down: manager/core/pool_node.py);
  * ``Save(to="disk")``: node host slot ``src`` -> disk slot ``dst`` (a write-down; the worker
    reads the host slot verified, like any load, so a torn host block is never written down
    as whole: it reports the write-down failed);
  * ``Load(frm="host")``: node host slot ``src`` -> the pool's device block ``dst``;
  * ``Load(frm="disk")``: disk slot ``src`` -> node host slot ``dst`` (a prefetch: the block
    is loaded to the device by a later step, once it landed in host memory).

On the wire each is a map ``{op, level, src, dst, key}`` (``op`` "save" or "load"; ``level`` the
destination of a save, the source of a load; a save from the private host tier adds
``source: "private"``); ``order_from_wire`` validates one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.shared.hashing import HASH_BYTES
from kvpool.shared.protocol import bad_field

LEVELS = ("host", "disk")  # the node tier's levels, fastest first
MAX_SLOT = (1 << 40) - 1


SOURCES = ("device", "private")  # where a save to the host level reads: the pool's device blocks, its private host tier


@dataclass(frozen=True, slots=True)
class Save:
    """A copy down: device (or the private host tier) -> host (``to="host"``), or host -> disk
    (``to="disk"``)."""

    to: str
    src: int
    dst: int
    key: bytes
    source: str = "device"  # of a save to "host": "device", or "private" (the pool's private host tier)

    def to_wire(self) -> dict:
        out = {"op": "save", "level": self.to, "src": self.src, "dst": self.dst, "key": self.key}
        if self.source != "device":
            out["source"] = self.source
        return out


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
    source = m.get("source", "device")
    if source not in SOURCES or (source != "device" and (op, level) != ("save", "host")):
        raise bad_field("order.source", f"one of {SOURCES}, and not 'device' only on a save to 'host'", source)
    if op == "save":
        return Save(level, m["src"], m["dst"], key, source)
    return Load(level, m["src"], m["dst"], key)


MAX_ORDERS = 1 << 16  # orders of one sub-op's result, or failed orders of one report
MAX_BATCH = (1 << 63) - 1


def _orders(m: dict, key: str) -> list[Order]:
    v = m.get(key, [])
    if type(v) is not list or len(v) > MAX_ORDERS:
        raise bad_field(f"node.{key}", f"a list of at most {MAX_ORDERS} orders", v)
    return [order_from_wire(o) for o in v]


def _batch(m: dict) -> int:
    v = m.get("batch")
    if type(v) is not int or not 0 <= v <= MAX_BATCH:
        raise bad_field("node.batch", "an int in [0, 2**63)", v)
    return v


@dataclass(slots=True)
class NodeOrders:
    """The node tier's orders of one sub-op, in a step's result: ``pre`` run before the step's
    forward pass (saves of device blocks being reused, loads, prefetches, write-downs), in the
    order given; ``post`` after it (saves of the blocks it computed, their write-downs).
    ``batch`` names the step's batch, which the worker reports done (``NodeReport``) once it ran
    them. Wire: ``{batch, pre?, post?}`` (a list absent when empty)."""

    batch: int
    pre: list[Order]
    post: list[Order]

    def to_wire(self) -> dict:
        out: dict = {"batch": self.batch}
        if self.pre:
            out["pre"] = [o.to_wire() for o in self.pre]
        if self.post:
            out["post"] = [o.to_wire() for o in self.post]
        return out

    @classmethod
    def from_wire(cls, m: object) -> NodeOrders:
        if type(m) is not dict:
            raise bad_field("node", "a map {batch, pre, post}", m)
        return cls(_batch(m), _orders(m, "pre"), _orders(m, "post"))


@dataclass(frozen=True, slots=True)
class NodeReport:
    """A worker ran batch ``batch``'s orders; those in ``failed`` did not land (a save that
    could not be written, a load that did not verify: the worker recomputed those blocks), and
    those in ``late`` did not land in time (a disk read or write-down past the worker's disk
    deadline: a read is recomputed too; the manager counts them apart from verify and save
    failures: a slow disk is not a corrupt one). An order is in at most one of the two lists. Wire: ``{batch, failed?, late?}``; a step message
    carries a list of them (``node_done``), so does the ``node_done`` op."""

    batch: int
    failed: tuple[Order, ...] = ()
    late: tuple[Order, ...] = ()

    def to_wire(self) -> dict:
        out: dict = {"batch": self.batch}
        if self.failed:
            out["failed"] = [o.to_wire() for o in self.failed]
        if self.late:
            out["late"] = [o.to_wire() for o in self.late]
        return out

    @classmethod
    def from_wire(cls, m: object) -> NodeReport:
        if type(m) is not dict:
            raise bad_field("node_done[]", "a map {batch, failed, late}", m)
        late = tuple(_orders(m, "late"))
        for o in late:
            if (o.frm if type(o) is Load else o.to) != "disk":
                raise bad_field("node_done.late", "disk loads and saves only (the orders with a deadline)", o.to_wire())
        failed = tuple(_orders(m, "failed"))
        if set(failed) & set(late):
            raise bad_field("node_done.late", "orders not also in failed", [o.to_wire() for o in late])
        return cls(_batch(m), failed, late)


def reports_from_wire(v: object, limit: int = 4096) -> list[NodeReport]:
    """A ``node_done`` list; ``bad_field`` for anything else."""
    if type(v) is not list or len(v) > limit:
        raise bad_field("node_done", f"a list of at most {limit} reports", v)
    return [NodeReport.from_wire(m) for m in v]
