"""A pool's complete state as msgpack-ready plain data, and back (pure, no I/O).

Used by the Redis store's snapshots and by ``kvpool snapshot`` / ``restore``. Integer arrays
travel as little-endian uint32 bytes and hashes as concatenated 32-byte strings, so a 1M-block
pool is a few tens of MB that msgpack handles without per-element objects. Restoring verifies
every invariant before the pool is handed out: corrupt or partial state raises
``CorruptState``, never a half-loaded pool.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import asdict

from kvpool.manager.core.block_pool import BlockPool
from kvpool.manager.core.bulk import array_to_list, bulk_store, split_every
from kvpool.manager.core.free_queue import FreeQueue
from kvpool.manager.core.host_tier import HostStats, HostTier
from kvpool.manager.core.pool import Pool, PoolStats, RequestBlocks
from kvpool.shared.hashing import HASH_BYTES

FORMAT = 1


class CorruptState(ValueError):
    """Persisted state that cannot be loaded as it is; says what is wrong."""


def ints(values) -> bytes:
    arr = array("I", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def sints(values) -> bytes:
    """Signed 64-bit little-endian (priorities, hit counts)."""
    arr = array("q", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unsints(data: bytes, what: str) -> list[int]:
    if type(data) is not bytes or len(data) % 8:
        raise CorruptState(f"{what}: expected int64 bytes")
    arr = array("q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def unints(data: bytes, what: str) -> list[int]:
    if type(data) is not bytes or len(data) % 4:
        raise CorruptState(f"{what}: expected uint32 bytes")
    arr = array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return array_to_list(arr)


def split_hashes(data: bytes, what: str) -> list[bytes]:
    if type(data) is not bytes or len(data) % HASH_BYTES:
        raise CorruptState(f"{what}: expected concatenated {HASH_BYTES}-byte hashes")
    return split_every(data, HASH_BYTES)  # in C (a 1M-block pool has 1M hashes), in pieces


def dump_blocks(bp: BlockPool) -> dict:
    hashed = [b for b in range(bp.num_blocks) if bp.block_hash[b] is not None]
    front, lru = bp.free_queue.segments()
    return {
        "num_blocks": bp.num_blocks,
        "enable_caching": bp.enable_caching,
        "ref_cnt": ints(bp.ref_cnt),
        "hashed_ids": ints(hashed),
        "hashes": b"".join(bp.block_hash[b] for b in hashed),  # type: ignore[misc]
        "primary": ints(bp.cached.values()),  # map entries, in map order
        "dups": [[h, ints(ids)] for h, ids in bp.duplicates().items()],
        "front": ints(front),
        "lru": ints(lru),
        "num_evictions": bp.num_evictions,
    }


def dump_pool(pool: Pool) -> dict:
    """The pool as plain data; a host tier (taken between steps: no pins) under ``"host"``."""
    d = {
        "format": FORMAT,
        "block_size": pool.block_size,
        **dump_blocks(pool.blocks),
        "requests": [
            [key[0], key[1], ints(r.blocks), r.num_tokens, b"".join(r.hashes), r.num_cached]
            if type(key) is tuple
            else [None, key, ints(r.blocks), r.num_tokens, b"".join(r.hashes), r.num_cached]
            for key, r in pool.requests.items()
        ],
        "stats": asdict(pool.stats),
    }
    if pool.host is not None:
        if pool.host.pinned:
            raise ValueError("a pool with host-tier pins is mid-step: snapshot it between steps")
        d["host"] = {**dump_blocks(pool.host.blocks), "stats": asdict(pool.host.stats)}
        if pool.host.policy != "demote":  # absent: the layout of snapshots from before the choice
            d["host"]["policy"] = pool.host.policy
    return d


def load_pool(d: dict, enable_events: bool = False, verify: bool = True) -> Pool:
    """Rebuilds a pool from ``dump_pool`` output; raises CorruptState unless it is whole.

    ``verify=False`` skips the invariant check (O(num_blocks)) for a caller that checks the
    whole state itself before using it (a recovery that replays a journal on top of it).
    """
    try:
        return _load(d, enable_events, verify)
    except CorruptState:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AssertionError) as e:
        raise CorruptState(f"pool snapshot is not loadable: {type(e).__name__}: {e}") from None


def _load(d: dict, enable_events: bool, verify: bool = True) -> Pool:
    if d.get("format") != FORMAT:
        raise CorruptState(f"pool snapshot format {d.get('format')!r}, expected {FORMAT}")
    bp = load_blocks(d, enable_events)
    requests: dict[object, RequestBlocks] = {}
    for owner, rid, blocks, num_tokens, hs, num_cached in d["requests"]:
        key = rid if owner is None else (owner, rid)
        requests[key] = RequestBlocks(unints(blocks, "request blocks"), num_tokens, split_hashes(hs, "request hashes"), num_cached)
    pool = Pool.restore(bp, d["block_size"], requests, PoolStats(**d["stats"]))
    if d.get("host") is not None:
        host = HostTier(2, d["block_size"], policy=d["host"].get("policy", "demote"))  # placeholder blocks
        host.blocks, host.stats = load_blocks(d["host"], enable_events), HostStats(**d["host"]["stats"])
        pool.set_host(host)
    if not verify:
        return pool
    try:
        pool.check_invariants()
    except AssertionError as e:
        raise CorruptState(f"pool snapshot breaks an invariant: {e}") from None
    return pool


def load_blocks(d: dict, enable_events: bool) -> BlockPool:
    n = d["num_blocks"]
    ref_cnt = unints(d["ref_cnt"], "ref_cnt")
    if len(ref_cnt) != n:
        raise CorruptState(f"ref_cnt has {len(ref_cnt)} entries for {n} blocks")
    ids = unints(d["hashed_ids"], "hashed_ids")
    hashes = split_hashes(d["hashes"], "hashes")
    if len(ids) != len(hashes):
        raise CorruptState("hashed_ids and hashes differ in length")
    block_hash: list[bytes | None] = [None] * n
    bulk_store(block_hash, ids, hashes)  # in C, in pieces (1M hashes at 1M blocks)
    free_queue = FreeQueue.from_segments(unints(d["front"], "front"), unints(d["lru"], "lru"))
    bp = BlockPool.restore(ref_cnt, block_hash, unints(d["primary"], "primary"),
                           {h: unints(raw, "dups") for h, raw in d["dups"]}, free_queue, d["num_evictions"],
                           enable_caching=d["enable_caching"], enable_events=enable_events)
    return bp
