"""Every invariant of a pool, checked in bulk: what recovery runs before a state is served.

``Pool.check_invariants`` walks the blocks one by one in Python (clear, and right for tests
after every operation); at 1M blocks that takes seconds. This module checks the same invariants
(DESIGN.md 1-4, 7 and the ref-count/holder balance) with set, map and Counter operations that
run in C, so a restarted manager verifies a 1M-block state in a fraction of a second; they run
in pieces (manager/core/bulk.py), so the thread that renews the lease while a state loads keeps
its turns. Each
check raises ``CorruptState`` naming what is wrong: explicit raises, never ``assert``, so
``python -O`` cannot turn the checks off.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, islice
from operator import eq, not_

from kvpool.manager.core.block_pool import NULL_BLOCK, BlockPool
from kvpool.manager.core.bulk import bulk_all, bulk_list, bulk_min, marks, pieces, truthy_at
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.snapshot import CorruptState


def verify_pool(pool: Pool, what: str = "pool") -> None:
    """Raises CorruptState unless ``pool`` satisfies every invariant."""
    try:
        _verify_pool(pool, what)
    except (IndexError, TypeError, ValueError) as e:  # a block id out of range, a wrong type
        if isinstance(e, CorruptState):
            raise
        raise CorruptState(f"{what}: malformed state: {type(e).__name__}: {e}") from None


def _verify_pool(pool: Pool, what: str) -> None:
    verify_blocks(pool.blocks, what)
    bs = pool.block_size
    for key, req in pool.requests.items():
        if len(req.blocks) < -(-req.num_tokens // bs):
            raise CorruptState(f"{what}: request {key!r:.60} holds {len(req.blocks)} blocks for {req.num_tokens} tokens")
    holders: Counter[int] = Counter()
    for part in pieces(chain.from_iterable(req.blocks for req in pool.requests.values())):
        holders.update(part)
    ref = pool.blocks.ref_cnt
    used = truthy_at(ref)
    # equal as maps: as many entries, and each used block held as often as it is counted
    if len(holders) != len(used) or not bulk_all(map(eq, map(holders.get, used), map(ref.__getitem__, used))):
        bad = next((b for b in set(holders) | set(used) if holders.get(b, 0) != ref[b]), None)
        raise CorruptState(f"{what}: block {bad}: ref_cnt {ref[bad] if bad is not None else '?'} but "
                           f"{holders.get(bad, 0)} request holdings")


def verify_blocks(bp: BlockPool, what: str = "pool") -> None:
    n, ref, bhash = bp.num_blocks, bp.ref_cnt, bp.block_hash
    if len(ref) != n or len(bhash) != n:
        raise CorruptState(f"{what}: {len(ref)} ref counts and {len(bhash)} hashes for {n} blocks")
    if ref[NULL_BLOCK] != 0 or bhash[NULL_BLOCK] is not None:
        raise CorruptState(f"{what}: the null block is in use or hashed")
    if bulk_min(ref) < 0:
        raise CorruptState(f"{what}: a negative ref_cnt (block {ref.index(min(ref))})")
    _verify_queue(bp, what)
    _verify_map(bp, what)


def _verify_queue(bp: BlockPool, what: str) -> None:
    """Free blocks are exactly those with ref_cnt 0 (block 0 aside), each queued once, and no
    unhashed block waits behind a hashed one."""
    n = len(bp.ref_cnt)
    order = bp.free_queue.order()
    if order and bulk_min(order) <= NULL_BLOCK:
        raise CorruptState(f"{what}: block {bulk_min(order)} is in the free queue (real blocks start at 1)")
    queued = marks(n, order)  # an id past the pool: IndexError, a malformed state
    if queued.count(1) != len(order):
        raise CorruptState(f"{what}: a block is twice in the free queue")
    free = bytearray()
    for part in pieces(bp.ref_cnt):
        free += bytes(map(not_, part))
    free[NULL_BLOCK] = 0
    if queued != free:
        diff = list(islice((b for b in range(n) if queued[b] != free[b]), 5))
        raise CorruptState(f"{what}: free queue and ref counts disagree (blocks {diff}: queued without ref_cnt 0, "
                           "or free but not queued)")
    seen_hashed = False
    for part in pieces(map(bool, map(bp.block_hash.__getitem__, order))):
        if not seen_hashed and True in part:
            seen_hashed, part = True, part[part.index(True):]
        if seen_hashed and False in part:
            raise CorruptState(f"{what}: an unhashed block is queued behind a hashed one")


def _verify_map(bp: BlockPool, what: str) -> None:
    """The map and its duplicates hold every hashed block once, each under its own hash."""
    bhash, cached, dups = bp.block_hash, bp.cached, bp._dups
    if not dups.keys() <= cached.keys() or not all(dups.values()):
        raise CorruptState(f"{what}: a duplicate list without a map entry, or an empty one")
    listed = bulk_list(chain(cached.values(), chain.from_iterable(dups.values())))
    keys = chain(cached.keys(), chain.from_iterable([h] * len(bs) for h, bs in dups.items()))
    if not bulk_all(map(eq, map(bhash.__getitem__, listed), keys)):
        raise CorruptState(f"{what}: a map entry points at a block without that hash")
    # Every listed block carries its (non-None) key: listed once each and as many as the hashed
    # blocks, they are exactly the hashed blocks.
    num_hashed = len(bhash) - sum(part.count(None) for part in pieces(bhash))
    if listed and bulk_min(listed) < 0:
        raise CorruptState(f"{what}: the hash map names block {bulk_min(listed)}")
    if len(listed) != num_hashed or marks(len(bhash), listed).count(1) != len(listed):
        raise CorruptState(f"{what}: hash map and block hashes disagree ({len(listed)} entries and duplicates, "
                           f"{num_hashed} hashed blocks)")
