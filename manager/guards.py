"""What one session may do and how much one message may cost: pool ownership, memory quotas,
and the bound on a step's work. Checks only: nothing here changes the registry, so a refused
message is never journaled, and a replayed journal never meets these checks again.

- **Ownership.** A pool belongs to the sessions of its registered shards. Only they, or an
  admin session (role ``admin``, PROTOCOL.md section 4), may step on it or register over one of
  its live shards; ``register`` with ``replace: true`` (the operator asked for a replacement)
  takes a shard from a live session. Registering a shard's current incarnation again is always
  allowed: a worker that lost its session (a timeout) re-binds its shard from a new one.
  A pool whose shards' sessions are all gone is anyone's to register.
- **Quotas.** The blocks of the shards one session holds (``max_session_blocks``) and of every
  pool (``max_total_blocks``) are bounded: the manager's memory is per block.
- **Step work.** Tokens per sub-op are bounded by the pool's declared ``max_model_len`` (the
  ``spec`` field, at most the manager's), and the blocks one step may hand out or share by
  ``max_step_blocks``: one message cannot hold the single loop for seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.manager.registry import PoolEntry, Registry, Session
from kvpool.shared.protocol import ManagerError
from kvpool.shared.step_ops import Alloc, Extend, Fork, Free, Refused, SubOp

DEFAULT_MAX_MODEL_LEN = 1 << 20


@dataclass(frozen=True)
class Bounds:
    max_step_blocks: int = 1 << 16  # blocks one step may hand out or share (alloc, extend, fork)
    max_session_blocks: int = 1 << 23  # blocks of the shards one session holds, all pools
    max_total_blocks: int = 1 << 26  # blocks of every pool together
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # tokens per request when a pool declares none, and the cap


def is_admin(sess: Session) -> bool:
    """An admin session: role admin, with the admin key when one is configured."""
    return sess.role == "admin" and sess.admin


def check_owner(reg: Registry, sess: Session, entry: PoolEntry) -> None:
    """``sess`` is live (it sent the message), so it owns the pool when it holds one of its shards."""
    sid = sess.sid
    for shard in entry.shards.values():
        if shard.sid == sid:
            return
    if is_admin(sess):
        return
    raise ManagerError("not_owner", f"pool {entry.name!r} belongs to the sessions of its shards; this session "
                       "holds none: register a shard of it first, or use an admin session")


def check_register(reg: Registry, bounds: Bounds, sess: Session, name: str, rank: int, incarnation: str,
                   num_blocks: int, replace: bool) -> None:
    """Ownership and quotas for one registration (``num_blocks``: what the shard's memory holds)."""
    entry = reg.pools.get(name)
    held = entry.shards.get(rank) if entry is not None else None
    if (held is not None and held.incarnation != incarnation and held.sid != sess.sid
            and held.sid in reg.sessions and not replace and not is_admin(sess)):
        holder = reg.sessions[held.sid]  # type: ignore[index]
        raise ManagerError("not_owner", f"shard {rank} of pool {name!r} is held by live session {holder.num} "
                           f"({holder.identity!r:.60}): stop that worker, or register with replace: true "
                           "to take the shard over (its requests are dropped)")
    blocks = min(num_blocks, reg.max_blocks)
    mine = sum(min(s.num_blocks, reg.max_blocks) for e in reg.pools.values() for s in e.shards.values()
               if s.sid == sess.sid and (e.name, s.rank) != (name, rank))
    if mine + blocks > bounds.max_session_blocks:
        raise ManagerError("quota_exceeded", f"this session's shards would hold {mine + blocks} blocks; the limit is "
                           f"{bounds.max_session_blocks} (max_session_blocks): register less KV memory")
    total = sum(_entry_blocks(reg, e) for e in reg.pools.values() if e.name != name) + blocks
    if total > bounds.max_total_blocks:
        raise ManagerError("quota_exceeded", f"the pools would hold {total} blocks; the manager's limit is "
                           f"{bounds.max_total_blocks} (max_total_blocks): register less KV memory or raise it")


def _entry_blocks(reg: Registry, entry: PoolEntry) -> int:
    if entry.pool is not None:
        return entry.pool.blocks.num_blocks
    return min([reg.max_blocks, *(s.num_blocks for s in entry.shards.values())])


def max_model_len(bounds: Bounds, entry: PoolEntry) -> int:
    """The pool's token bound per request: the least its shards declared, at most the manager's."""
    declared = [s.spec.max_model_len for s in entry.shards.values() if s.spec.max_model_len is not None]
    return min([bounds.max_model_len, *declared])


def check_step(bounds: Bounds, entry: PoolEntry, owner: str, ops: list[SubOp | Refused]) -> None:
    """Refuses (nothing run) a step whose sub-ops ask for more tokens than the pool's
    max_model_len, or more new or shared blocks in all than ``max_step_blocks``.

    One pass checks the tokens and sums a bound on the blocks that needs no block table: an
    alloc's exact count, and for an extend the blocks of its whole token count plus one (a
    copy-on-write of a shared last block), at least what it can add. Only a step over that bound,
    or with a fork (whose work is its parent's table), is projected exactly (``_projected_work``).
    ``ops`` are decoded (shared/step_ops.decode_ops); a sub-op that failed to decode is its own
    error, later, and counts for nothing here.
    A decode step of a few hundred requests is far under the bound and is never projected."""
    limit = max_model_len(bounds, entry)
    bs = entry.pool.block_size  # type: ignore[union-attr]
    bound, exact = 0, False
    for i, op in enumerate(ops):
        kind = type(op)
        if kind is Extend:
            n, la = op.num_tokens, op.lookahead or 0  # type: ignore[union-attr]
            if n > limit or la > limit:
                _too_long(entry, limit, i, "num_tokens" if n > limit else "lookahead", n if n > limit else la)
            bound += -(-(n + la) // bs) + 1
        elif kind is Alloc:
            p, la = op.prompt_len, op.lookahead or 0  # type: ignore[union-attr]
            if p > limit or la > limit:
                _too_long(entry, limit, i, "prompt_len" if p > limit else "lookahead", p if p > limit else la)
            bound += -(-(min(op.max_new, p) + la) // bs) + 1  # type: ignore[union-attr]
        elif kind is Fork:
            exact = True
    if exact or bound > bounds.max_step_blocks:
        work = _projected_work(bs, entry, owner, ops)
        if work > bounds.max_step_blocks:
            raise ManagerError("step_too_large", f"this step may hand out or share up to {work} blocks; at most "
                               f"{bounds.max_step_blocks} per step (max_step_blocks): split it over several steps")


def _too_long(entry: PoolEntry, limit: int, i: int, key: str, value: int) -> None:
    raise ManagerError("bad_field", f"ops[{i}].{key} is {value}; pool {entry.name!r} takes at most "
                       f"{limit} tokens per request (its max_model_len)")


def _projected_work(bs: int, entry: PoolEntry, owner: str, ops: list[SubOp | Refused]) -> int:
    """The blocks the step may hand out or share, block tables projected through it (an extend
    or fork of a request admitted earlier in the step). An extend may need one block beyond its
    token count (a copy-on-write of a shared last block)."""
    held = entry.pool.requests  # type: ignore[union-attr]
    sizes: dict[object, int] = {}  # request -> its block table's size after the sub-ops so far
    work = 0
    for op in ops:
        kind = type(op)
        if kind is Refused:
            continue
        req = op.req  # type: ignore[union-attr]
        if kind is Alloc:
            lookahead = op.lookahead or 0  # type: ignore[union-attr]
            work += -(-(min(op.max_new, op.prompt_len) + lookahead) // bs) + 1  # type: ignore[union-attr]
            sizes[req] = -(-(op.prompt_len + lookahead) // bs)  # type: ignore[union-attr]
            continue
        size = sizes.get(req)
        if size is None:
            got = held.get((owner, req))
            size = len(got.blocks) if got is not None else 0
        if kind is Extend:
            grown = max(size, -(-(op.num_tokens + (op.lookahead or 0)) // bs)) + 1  # type: ignore[union-attr]  # +1: a copy
            work += grown - size
            sizes[req] = grown
        elif kind is Fork:
            work += size
            sizes[op.child] = size  # type: ignore[union-attr]
        elif kind is Free:
            sizes[req] = 0
    return work
