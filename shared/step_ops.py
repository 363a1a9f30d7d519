"""The step message's sub-ops and their results as records, with their one wire codec.

A step (PROTOCOL.md section 6) carries a list of sub-ops and is answered with one result per
sub-op. Each record here has one ``from_wire`` (the only validation of that sub-op: the daemon,
the in-process block manager and the journal's replay all decode through it) and one
``to_wire``, whose map is byte for byte the documented one: the same keys in the same order,
an optional key absent when its field is ``None``::

    Alloc   {"op": "alloc", "req", "hashes", "prompt_len", "max_new", "lookahead"?, "priority"?}
    Extend  {"op": "extend", "req", "num_tokens", "hashes"?, "lookahead"?, "base"?}
    Free    {"op": "free", "req", "computed"?}
    Fork    {"op": "fork", "req", "child"}

    AllocResult   {"ok": true, "cached", "blocks", "writes"?, "saves"?, "loads"?, "node"?}
    ExtendResult  {"ok": true, "blocks", "copies", "writes"?, "saves"?, "loads"?, "node"?}
    Freed         {"ok": true}
    Forked        {"ok": true, "blocks"}
    Refused       {"ok": false, "code", "msg"}

Results carry no kind: ``decode_results`` reads each by the sub-op it answers. A bad sub-op
decodes to a ``Refused`` (``decode_ops``), which the step answers as is: the others still run.
The records are slotted and built by position, with the checks inline (the step path runs
hundreds per step); ``dataclasses.asdict`` and per-field reflection are never used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.shared.hashing import HASH_BYTES
from kvpool.shared.node_orders import NodeOrders
from kvpool.shared.protocol import MAX_HASHES, ManagerError, short_repr

MAX_COUNT = 1 << 31  # bound on token and block counts in one sub-op
MAX_REQ_ID_LEN = 128
_REQ_INT_END = 1 << 63

ReqId = int | str


def _int(op: dict, key: str, default: int | None = None) -> int:
    v = op.get(key, default)
    if type(v) is not int or not 0 <= v < MAX_COUNT:
        raise ManagerError("bad_field", f"field {key!r} must be an int in [0, 2**31), got {short_repr(v)}")
    return v


def _opt_int(op: dict, key: str) -> int | None:
    return _int(op, key) if key in op else None


def _req(op: dict, key: str = "req") -> ReqId:
    v = op.get(key)
    if type(v) is int and 0 <= v < _REQ_INT_END:
        return v
    if type(v) is str and 0 < len(v) <= MAX_REQ_ID_LEN:
        return v
    raise ManagerError("bad_field", f"field {key!r} must be an int >= 0 or a str of 1-128 chars, got {short_repr(v)}")


def _priority(op: dict) -> int:
    v = op.get("priority")
    if type(v) is not int or not -MAX_COUNT <= v < MAX_COUNT:
        raise ManagerError("bad_field", f"field 'priority' must be an int in [-2**31, 2**31), got {short_repr(v)}")
    return v


def _hashes(op: dict) -> list[bytes]:
    hs = op.get("hashes", ())
    if type(hs) not in (list, tuple) or len(hs) > MAX_HASHES:
        raise ManagerError("bad_field", f"field 'hashes' must be a list of at most {MAX_HASHES} 32-byte strings")
    for h in hs:
        if type(h) is not bytes or len(h) != HASH_BYTES:
            raise ManagerError("bad_hash", f"every hash must be {HASH_BYTES} bytes, got {short_repr(h, 40)}")
    return hs  # type: ignore[return-value]


# -- sub-ops ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Alloc:
    """Admits ``req``: its prompt's block hashes, ``max_new`` tokens computed by this step."""

    name: ClassVar[str] = "alloc"
    req: ReqId
    hashes: list[bytes]
    prompt_len: int
    max_new: int
    lookahead: int | None = None
    priority: int | None = None  # vLLM's request priority (lower: kept longer in the node tier)

    @classmethod
    def from_wire(cls, op: dict) -> Alloc:
        return cls(_req(op), _hashes(op), _int(op, "prompt_len"), _int(op, "max_new"), _opt_int(op, "lookahead"),
                   _priority(op) if "priority" in op else None)

    def to_wire(self) -> dict:
        w = {"op": "alloc", "req": self.req, "hashes": self.hashes, "prompt_len": self.prompt_len,
             "max_new": self.max_new}
        if self.lookahead is not None:
            w["lookahead"] = self.lookahead
        if self.priority is not None:
            w["priority"] = self.priority
        return w


@dataclass(slots=True)
class Extend:
    """Grows ``req`` to ``num_tokens``; ``base``: valid only if it holds exactly that many."""

    name: ClassVar[str] = "extend"
    req: ReqId
    num_tokens: int
    hashes: list[bytes] | None = None
    lookahead: int | None = None
    base: int | None = None

    @classmethod
    def from_wire(cls, op: dict) -> Extend:
        # The hot sub-op (every decode step): fields are checked inline, and only a field that
        # fails the quick check goes through its full validator, which raises the error.
        get = op.get
        req = get("req")
        if not ((type(req) is int and 0 <= req < _REQ_INT_END) or (type(req) is str and 0 < len(req) <= MAX_REQ_ID_LEN)):
            req = _req(op)
        base = _int(op, "base") if "base" in op else None
        num_tokens = get("num_tokens")
        if type(num_tokens) is not int or not 0 <= num_tokens < MAX_COUNT:
            num_tokens = _int(op, "num_tokens")
        hashes = _hashes(op) if "hashes" in op else None
        lookahead = get("lookahead")
        if lookahead is not None or "lookahead" in op:
            if type(lookahead) is not int or not 0 <= lookahead < MAX_COUNT:
                lookahead = _int(op, "lookahead")
        return cls(req, num_tokens, hashes, lookahead, base)

    def to_wire(self) -> dict:
        w = {"op": "extend", "req": self.req, "num_tokens": self.num_tokens}
        if self.hashes is not None:
            w["hashes"] = self.hashes
        if self.lookahead is not None:
            w["lookahead"] = self.lookahead
        if self.base is not None:
            w["base"] = self.base
        return w


@dataclass(slots=True)
class Free:
    """Releases ``req``; ``computed``: tokens whose K/V the client wrote (hashes past them dropped)."""

    name: ClassVar[str] = "free"
    req: ReqId
    computed: int | None = None

    @classmethod
    def from_wire(cls, op: dict) -> Free:
        return cls(_req(op), _opt_int(op, "computed"))

    def to_wire(self) -> dict:
        w = {"op": "free", "req": self.req}
        if self.computed is not None:
            w["computed"] = self.computed
        return w


@dataclass(slots=True)
class Fork:
    """``child`` shares ``req``'s blocks."""

    name: ClassVar[str] = "fork"
    req: ReqId
    child: ReqId

    @classmethod
    def from_wire(cls, op: dict) -> Fork:
        return cls(_req(op), _req(op, "child"))

    def to_wire(self) -> dict:
        return {"op": "fork", "req": self.req, "child": self.child}


SubOp = Alloc | Extend | Free | Fork
SUB_OPS: dict[str, type[Alloc] | type[Extend] | type[Free] | type[Fork]] = {
    "alloc": Alloc, "extend": Extend, "free": Free, "fork": Fork}


# -- results ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Refused:
    """A sub-op that changed nothing: ``no_space``, ``draining`` or a bad-input code."""

    ok: ClassVar[bool] = False
    code: str
    msg: str

    def to_wire(self) -> dict:
        return {"ok": False, "code": self.code, "msg": self.msg}

    @classmethod
    def from_wire(cls, res: dict) -> Refused:
        code = res.get("code")
        msg = res.get("msg", code)
        if type(code) is not str or type(msg) is not str:
            raise ManagerError("bad_message", f"a refused sub-op's result needs str code and msg, got {short_repr(res)}")
        return cls(code, msg)


NO_SPACE = Refused("no_space", "not enough free blocks")


def _copies(res: dict, key: str) -> list[list[int]] | None:
    v = res.get(key)
    if v is not None and type(v) is not list:
        raise ManagerError("bad_message", f"result field {key!r} must be a list of [src, dst], got {short_repr(v)}")
    return v


def _orders(w: dict, writes: list | None, saves: list | None, loads: list | None, node: NodeOrders | None) -> dict:
    if writes:
        w["writes"] = writes
    if saves:
        w["saves"] = saves
    if loads:
        w["loads"] = loads
    if node is not None:
        w["node"] = node.to_wire()
    return w


def _node(res: dict) -> NodeOrders | None:
    m = res.get("node")
    if m is None:
        return None
    try:
        return NodeOrders.from_wire(m)
    except ManagerError as e:
        raise ManagerError("bad_message", f"result field 'node': {e.message}") from None


def _blocks(res: dict) -> list[int]:
    v = res.get("blocks")
    if type(v) is not list:
        raise ManagerError("bad_message", f"result field 'blocks' must be a list, got {short_repr(v)}")
    return v


@dataclass(slots=True)
class AllocResult:
    """``cached``: prompt tokens found cached (host-tier loads included); the host tier's orders
    (``writes``, ``saves`` [device, host]; ``loads`` [host, device]) and the node tier's
    (``node``) only when there are any."""

    ok: ClassVar[bool] = True
    cached: int
    blocks: list[int]
    writes: list[list[int]] | None = None
    saves: list[list[int]] | None = None
    loads: list[list[int]] | None = None
    node: NodeOrders | None = None

    def to_wire(self) -> dict:
        return _orders({"ok": True, "cached": self.cached, "blocks": self.blocks}, self.writes, self.saves,
                       self.loads, self.node)

    @classmethod
    def from_wire(cls, res: dict) -> AllocResult:
        cached = res.get("cached")
        if type(cached) is not int or cached < 0:
            raise ManagerError("bad_message", f"result field 'cached' must be an int >= 0, got {short_repr(cached)}")
        return cls(cached, _blocks(res), _copies(res, "writes"), _copies(res, "saves"), _copies(res, "loads"),
                   _node(res))


@dataclass(slots=True)
class ExtendResult:
    """``blocks``: the new ones; ``copies``: [index, src, dst] copy-on-write replacements."""

    ok: ClassVar[bool] = True
    blocks: list[int]
    copies: list[list[int]]
    writes: list[list[int]] | None = None
    saves: list[list[int]] | None = None
    loads: list[list[int]] | None = None
    node: NodeOrders | None = None

    def to_wire(self) -> dict:
        return _orders({"ok": True, "blocks": self.blocks, "copies": self.copies}, self.writes, self.saves,
                       self.loads, self.node)

    @classmethod
    def from_wire(cls, res: dict) -> ExtendResult:
        copies = res.get("copies")
        if type(copies) is not list:
            raise ManagerError("bad_message", f"result field 'copies' must be a list, got {short_repr(copies)}")
        return cls(_blocks(res), copies, _copies(res, "writes"), _copies(res, "saves"), _copies(res, "loads"),
                   _node(res))


@dataclass(slots=True)
class Freed:
    ok: ClassVar[bool] = True

    def to_wire(self) -> dict:
        return {"ok": True}

    @classmethod
    def from_wire(cls, res: dict) -> Freed:
        return FREED


FREED = Freed()


@dataclass(slots=True)
class Forked:
    ok: ClassVar[bool] = True
    blocks: list[int]

    def to_wire(self) -> dict:
        return {"ok": True, "blocks": self.blocks}

    @classmethod
    def from_wire(cls, res: dict) -> Forked:
        return cls(_blocks(res))


Result = AllocResult | ExtendResult | Freed | Forked | Refused
_RESULTS = {Alloc: AllocResult, Extend: ExtendResult, Free: Freed, Fork: Forked}


# -- whole steps -----------------------------------------------------------------------------


def decode_op(op: object) -> SubOp | Refused:
    """One wire sub-op as its record, or the ``Refused`` that answers it."""
    try:
        if type(op) is not dict:
            return Refused("bad_sub_op", f"a sub-op must be a map, got {type(op).__name__}")
        name = op.get("op")
        cls = SUB_OPS.get(name) if type(name) is str else None
        if cls is None:
            return Refused("unknown_sub_op", f"unknown sub-op {short_repr(name, 40)}; known: {sorted(SUB_OPS)}")
        return cls.from_wire(op)
    except ManagerError as e:
        return Refused(e.code, e.message)


def decode_ops(ops: list) -> list[SubOp | Refused]:
    """A step message's sub-ops (a bad one becomes the ``Refused`` that answers it)."""
    return [decode_op(op) for op in ops]


def encode_ops(ops: list[SubOp]) -> list[dict]:
    return [op.to_wire() for op in ops]


def encode_results(results: list[Result]) -> list[dict]:
    return [r.to_wire() for r in results]


def decode_results(ops: list[SubOp], results: list) -> list[Result]:
    """The manager's answers to ``ops``, each read as the result of the sub-op it answers."""
    if type(results) is not list or len(results) != len(ops):
        n = len(results) if type(results) is list else short_repr(results)
        raise ManagerError("bad_message", f"{n} results for {len(ops)} sub-ops")
    out: list[Result] = []
    for op, res in zip(ops, results):
        if type(res) is not dict:
            raise ManagerError("bad_message", f"a sub-op result must be a map, got {short_repr(res)}")
        out.append(_RESULTS[type(op)].from_wire(res) if res.get("ok") is True else Refused.from_wire(res))
    return out
