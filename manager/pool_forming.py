"""How a pool forms from its shards: whether a registering shard is valid and fits the pool,
the Pool and epoch a pool gets once every shard has registered, and which shards a pool keeps
when some leave. ``Registry`` (manager/registry.py) calls these on the entries it owns; none
touches anything but the entry or record it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Container

from kvpool.manager.core.pool import Pool
from kvpool.manager.state.entries import COMMON_SPEC, PoolEntry
from kvpool.manager.state.mutations import ShardRegistered
from kvpool.shared.protocol import KVSpec, ManagerError

logger = logging.getLogger(__name__)


def shard_blocks(rec: ShardRegistered) -> int:
    """The blocks a registering shard's KV memory holds; refuses a rank outside the pool and
    memory for fewer than 2 blocks (block 0 is the null block). Changes nothing."""
    if rec.rank >= rec.count:
        raise ManagerError("bad_field", f"shard_rank {rec.rank} must be < shard_count {rec.count}")
    per_block = rec.spec.block_bytes
    num_blocks = rec.available_kv_bytes // per_block
    if num_blocks < 2:
        raise ManagerError(
            "insufficient_memory",
            f"shard {rec.rank} of pool {rec.pool!r}: {rec.available_kv_bytes} KV bytes hold "
            f"{num_blocks} blocks of {per_block} bytes; at least 2 are needed: free memory or use "
            "a smaller block_size",
        )
    return num_blocks


def remove_shards(entry: PoolEntry, ranks: list[int]) -> None:
    """Forgets the shards ``ranks`` of ``entry``; when all of them go, one stays (its session
    gone) so the pool keeps its spec for the shards that return."""
    for r in ranks if len(ranks) < len(entry.shards) else ranks[1:]:
        del entry.shards[r]


def compatible(entry: PoolEntry, rank: int, count: int, spec: KVSpec, sessions: Container[str]) -> bool:
    """False when a new deployment replaces the pool (a new shard_count with no other shard,
    or every other shard gone and this one disagrees); raises spec_mismatch when a live
    shard disagrees. Changes nothing."""
    others = [s for r, s in entry.shards.items() if r != rank]
    if not others:
        if count == entry.shard_count:
            return True
        # A new deployment: a fresh entry, never a ready Pool whose shard_count its shards
        # no longer match (and nothing changed here before register may still raise).
        logger.warning("pool %s: shard %d registers with shard_count %d (pool: %d); replacing the pool",
                       entry.name, rank, count, entry.shard_count)
        return False
    want = {k: getattr(others[0].spec, k) for k in COMMON_SPEC}
    have = {k: getattr(spec, k) for k in COMMON_SPEC}
    if have == want and count == entry.shard_count:
        return True
    if all(s.sid is None or s.sid not in sessions for s in others):
        logger.warning("pool %s: shards %s are gone and shard %d disagrees; replacing the pool",
                       entry.name, [s.rank for s in others], rank)
        return False
    diffs = [f"{k} {have[k]!r} (pool: {want[k]!r})" for k in COMMON_SPEC if have[k] != want[k]]
    if count != entry.shard_count:
        diffs.append(f"shard_count {count} (pool: {entry.shard_count})")
    raise ManagerError(
        "spec_mismatch",
        f"shard {rank} of pool {entry.name!r} disagrees with the registered shards "
        f"{sorted(r for r in entry.shards if r != rank)}: {', '.join(diffs)}; every shard of a "
        "pool must run the same model, block_size, dtype and shard_count",
    )

def new_epoch(entry: PoolEntry, max_blocks: int, kv_events: bool = True) -> None:
    """Every shard has registered: the entry gets a Pool of the fewest blocks any shard holds
    (at most ``max_blocks``) and the next epoch; its KV events are queued when ``kv_events``."""
    num_blocks = min(s.num_blocks for s in entry.shards.values())
    if num_blocks > max_blocks:
        logger.warning("pool %s: %d blocks clamped to max_blocks %d", entry.name, num_blocks, max_blocks)
        num_blocks = max_blocks
    restarted = entry.epoch > 0  # an earlier Pool of this name had cached hashes
    pool = Pool(num_blocks, entry.spec.block_size, enable_events=kv_events,
                host_blocks=min(entry.host_num_blocks, max_blocks), host_policy=entry.host_policy)
    entry.form(pool)
    if restarted:
        pool.restate_events()  # the new pool is empty, both tiers: a clear
        logger.warning("pool %s: a shard restarted; epoch %d, cache and requests dropped", entry.name, entry.epoch)
    else:
        logger.info("pool %s ready: %d blocks, epoch %d", entry.name, num_blocks, entry.epoch)
