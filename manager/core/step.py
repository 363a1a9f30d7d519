"""Executes the sub-ops of one scheduler step against a pool (pure, no I/O).

The same code serves the daemon (``manager/server.py``) and in-process use (the worker's local
block manager, benchmarks), so a step means the same thing everywhere. Sub-ops run in order;
each is atomic; a bad sub-op gets an error result and changes nothing, the others still run.

The sub-ops and results are records (shared/step_ops.py, which holds their one wire codec and
validation); their wire schemas (msgpack maps; PROTOCOL.md is the reference):
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
(manager/core/host_tier.py). With a node tier, an alloc or extend result may carry "node":
{"batch", "pre"?, "post"?} (shared/node_orders.py; manager/core/pool_node.py says which).
R is an int in [0, 2**63) or a str of at most 128 bytes; ids are scoped by ``owner``. A pool error
names the request by its id alone (``PoolError.public``): the owner is the caller's own.
"""

from __future__ import annotations

from kvpool.manager.core.pool import Pool, PoolError
from kvpool.shared.node_orders import NodeOrders
from kvpool.shared.step_ops import (
    FREED,
    NO_SPACE,
    Alloc,
    AllocResult,
    Extend,
    ExtendResult,
    Forked,
    Free,
    Refused,
    Result,
    SubOp,
)

_DRAINING = Refused("draining", "the manager is draining: no new allocations")


def _alloc(pool: Pool, owner: object, op: Alloc) -> AllocResult | Refused:
    res = pool.allocate((owner, op.req), op.hashes, op.prompt_len, op.max_new, op.lookahead or 0, op.priority or 0)
    if res is None:
        return NO_SPACE
    return AllocResult(res[0], list(res[1]))  # a copy: a later sub-op may grow it


def _extend(pool: Pool, owner: object, op: Extend) -> ExtendResult | Refused:
    key = (owner, op.req)
    base = op.base
    if base is not None:
        held = pool.requests.get(key)
        if held is not None and held.num_tokens != base:
            raise PoolError("stale_base", f"request {{req}} holds {held.num_tokens} tokens, not base {base}: "
                            "an earlier sub-op for it was refused; free it", key)
    res = pool.extend(key, op.num_tokens, op.hashes or (), op.lookahead or 0)
    if res is None:
        return NO_SPACE
    copies = res[1]
    return ExtendResult(res[0], [list(c) for c in copies] if copies else [])


def run_step(pool: Pool, owner: object, ops: list[SubOp | Refused], allow_alloc: bool = True) -> list[Result]:
    """Runs ``ops`` in order for requests owned by ``owner``; one result per sub-op. A
    ``Refused`` among them (a sub-op that failed to decode, shared/step_ops.decode_ops) is its
    own answer.

    ``allow_alloc=False`` (a draining manager) refuses alloc and fork with code "draining".
    With a node tier the step's orders form one batch, ``(owner, n)``, ``n`` numbered by the
    tier (``NodeTier.batch_key``); its result carries ``n`` and the worker reports the batch by it.
    """
    results: list[Result] = []
    append, host = results.append, pool.tiered
    if pool.node is not None:
        pool.node.owner = pool.node.tier.batch_key(owner)
    for op in ops:
        kind = type(op)
        try:
            if kind is Extend:
                res = _extend(pool, owner, op)  # type: ignore[arg-type]
            elif kind is Refused:
                append(op)  # type: ignore[arg-type]
                continue
            elif kind is Free:
                pool.free((owner, op.req), op.computed)  # type: ignore[union-attr]
                res = FREED
            elif not allow_alloc:
                res = _DRAINING
            elif kind is Alloc:
                res = _alloc(pool, owner, op)  # type: ignore[arg-type]
            else:
                res = Forked(pool.fork((owner, op.req), (owner, op.child)))  # type: ignore[union-attr]
            if host:
                _add_copies(pool, res)
            append(res)
        except PoolError as e:
            append(Refused(e.code, e.public()))
    pool.end_step()
    return results


def _add_copies(pool: Pool, res: Result) -> None:
    """The tiers' orders of the sub-op just run, in its result (only when there are any)."""
    saves, loads, writes = pool.take_copies()
    node = pool.node
    if node is not None:
        pre, post = node.take_orders()
        if (pre or post) and (type(res) is AllocResult or type(res) is ExtendResult):
            res.node = NodeOrders(node.owner[1], pre, post)  # type: ignore[index]
    if not (saves or loads or writes) or (type(res) is not AllocResult and type(res) is not ExtendResult):
        return  # only an admission or a growth takes blocks that can have orders
    if writes:
        res.writes = [[c.src, c.dst] for c in writes]
    if saves:
        res.saves = [[c.src, c.dst] for c in saves]
    if loads:
        res.loads = [[c.src, c.dst] for c in loads]
