"""Executes the sub-ops of one scheduler step against a pool (pure, no I/O).

The same code serves the daemon (``manager/server.py``) and in-process use (the worker's local
block manager, benchmarks), so a step means the same thing everywhere. Sub-ops run in order;
each is atomic; a bad sub-op gets an error result and changes nothing, the others still run.

Sub-op schemas (msgpack maps; PROTOCOL.md is the reference):
  {"op": "alloc",  "req": R, "hashes": [bytes32...], "prompt_len": int, "max_new": int,
   "lookahead": int = 0}
      -> {"ok": true, "cached": int, "blocks": [int...]}        (cached = tokens found cached)
  {"op": "extend", "req": R, "num_tokens": int, "hashes": [bytes32...] = [], "lookahead": int = 0,
   "base": int = absent}
      -> {"ok": true, "blocks": [new int...], "copies": [[index, src, dst]...]}
      base: refused with "stale_base" unless the request holds exactly that many tokens (a
      pipelined step whose previous sub-op for the request was refused must not run)
  {"op": "free",   "req": R, "computed": int = absent} -> {"ok": true}
      computed: tokens of the request whose K/V the client wrote; the hashes of its blocks past
      them are dropped (a step the client had sent for it never ran)
  {"op": "fork",   "req": R, "child": R}        -> {"ok": true, "blocks": [int...]}
  no space: {"ok": false, "code": "no_space", "msg": ...}; bad input: another code.
With a host tier, an alloc or extend result may also carry "saves": [[device, host]...] (cached
device blocks it reuses, saved first) and an alloc "loads": [[host, device]...] (its prefix blocks
found in the host tier; counted in "cached"). Under the write-through policy an alloc or extend
result may carry "writes": [[device, host]...] (blocks that became full this step). The worker runs
every save of the step, then every load, then its forward pass, then every write
(manager/core/host_tier.py).
R is an int in [0, 2**63) or a str of at most 128 bytes; ids are scoped by ``owner``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvpool.manager.core.pool import Pool, PoolError
from kvpool.shared.hashing import HASH_BYTES
from kvpool.shared.protocol import MAX_HASHES, short_repr

MAX_COUNT = 1 << 31  # bound on token and block counts in one sub-op
MAX_REQ_ID_LEN = 128
_REQ_INT_END = 1 << 63
NO_SPACE = {"ok": False, "code": "no_space", "msg": "not enough free blocks"}
OK = {"ok": True}


def _int(op: dict, key: str, default: int | None = None) -> int:
    v = op.get(key, default)
    if type(v) is not int or not 0 <= v < MAX_COUNT:
        raise PoolError("bad_field", f"field {key!r} must be an int in [0, 2**31), got {short_repr(v)}")
    return v


def _req(op: dict, key: str = "req") -> int | str:
    v = op.get(key)
    if type(v) is int and 0 <= v < _REQ_INT_END:
        return v
    if type(v) is str and 0 < len(v) <= MAX_REQ_ID_LEN:
        return v
    raise PoolError("bad_field", f"field {key!r} must be an int >= 0 or a str of 1-128 chars, got {short_repr(v)}")


def _hashes(op: dict) -> list[bytes]:
    hs = op.get("hashes", ())
    if type(hs) not in (list, tuple) or len(hs) > MAX_HASHES:
        raise PoolError("bad_field", f"field 'hashes' must be a list of at most {MAX_HASHES} 32-byte strings")
    for h in hs:
        if type(h) is not bytes or len(h) != HASH_BYTES:
            raise PoolError("bad_hash", f"every hash must be {HASH_BYTES} bytes, got {short_repr(h, 40)}")
    return hs  # type: ignore[return-value]


def _alloc(pool: Pool, owner: object, op: dict) -> dict:
    res = pool.allocate(
        (owner, _req(op)), _hashes(op), _int(op, "prompt_len"), _int(op, "max_new"), _int(op, "lookahead", 0)
    )
    if res is None:
        return NO_SPACE
    return {"ok": True, "cached": res[0], "blocks": list(res[1])}  # a copy: a later sub-op may grow it


def _extend(pool: Pool, owner: object, op: dict) -> dict:
    # The hot sub-op (every decode step): fields are checked inline, and only a field that
    # fails the quick check goes through its full validator, which raises the error.
    req = op.get("req")
    if not ((type(req) is int and 0 <= req < _REQ_INT_END) or (type(req) is str and 0 < len(req) <= MAX_REQ_ID_LEN)):
        req = _req(op)
    key = (owner, req)
    if "base" in op:
        base, held = _int(op, "base"), pool.requests.get(key)
        if held is not None and held.num_tokens != base:
            raise PoolError("stale_base", f"request {key!r} holds {held.num_tokens} tokens, not base {base}: "
                            "an earlier sub-op for it was refused; free it")
    num_tokens = op.get("num_tokens")
    if type(num_tokens) is not int or not 0 <= num_tokens < MAX_COUNT:
        num_tokens = _int(op, "num_tokens")
    hashes = _hashes(op) if "hashes" in op else ()
    lookahead = op.get("lookahead", 0)
    if type(lookahead) is not int or not 0 <= lookahead < MAX_COUNT:
        lookahead = _int(op, "lookahead", 0)
    res = pool.extend(key, num_tokens, hashes, lookahead)
    if res is None:
        return NO_SPACE
    copies = res[1]
    return {"ok": True, "blocks": res[0], "copies": [list(c) for c in copies] if copies else []}


def _free(pool: Pool, owner: object, op: dict) -> dict:
    pool.free((owner, _req(op)), _int(op, "computed") if "computed" in op else None)
    return OK


def _fork(pool: Pool, owner: object, op: dict) -> dict:
    return {"ok": True, "blocks": pool.fork((owner, _req(op)), (owner, _req(op, "child")))}


SUB_OPS: dict[str, Callable[[Pool, object, dict], dict]] = {
    "alloc": _alloc,
    "extend": _extend,
    "free": _free,
    "fork": _fork,
}


def _public(msg: str, owner: object) -> str:
    """Pool messages name requests by their internal (owner, req) key; show only req."""
    return re.sub(rf"\({re.escape(repr(owner))}, ([^)]*)\)", r"\1", msg)


def run_step(pool: Pool, owner: object, ops: list, allow_alloc: bool = True) -> list[dict]:
    """Runs ``ops`` in order for requests owned by ``owner``; one result per sub-op.

    ``allow_alloc=False`` (a draining manager) refuses alloc and fork with code "draining".
    """
    results: list[dict] = []
    append, host = results.append, pool.host
    for op in ops:
        try:
            if type(op) is not dict:
                raise PoolError("bad_sub_op", f"a sub-op must be a map, got {type(op).__name__}")
            name = op.get("op")
            handler = SUB_OPS.get(name)  # type: ignore[arg-type]
            if handler is None:
                raise PoolError("unknown_sub_op", f"unknown sub-op {short_repr(name, 40)}; known: {sorted(SUB_OPS)}")
            if not allow_alloc and name in ("alloc", "fork"):
                raise PoolError("draining", "the manager is draining: no new allocations")
            res = handler(pool, owner, op)
            if host is not None:
                _add_copies(pool, res)
            append(res)
        except PoolError as e:
            append({"ok": False, "code": e.code, "msg": _public(str(e), owner)})
        except TypeError as e:  # e.g. an unhashable request id inside a malformed map
            append({"ok": False, "code": "bad_sub_op", "msg": f"malformed sub-op: {e}"})
    pool.end_step()
    return results


def _add_copies(pool: Pool, res: dict) -> None:
    """The host tier's orders of the sub-op just run, in its result (only when there are any)."""
    saves, loads, writes = pool.take_copies()
    if writes:
        res["writes"] = [[c.src, c.dst] for c in writes]
    if saves:
        res["saves"] = [[c.src, c.dst] for c in saves]
    if loads:
        res["loads"] = [[c.src, c.dst] for c in loads]
