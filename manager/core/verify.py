"""Every invariant of a pool, checked in bulk: what recovery runs before a state is served.

``Pool.check_invariants`` walks the blocks one by one in Python (clear, and right for tests
after every operation); at 1M blocks that takes seconds. This module checks the same invariants
(DESIGN.md 1-4, 7 and the ref-count/holder balance) with set, map and Counter operations that
run in C, so a restarted manager verifies a 1M-block state in a fraction of a second. Each
check raises ``CorruptState`` naming what is wrong: explicit raises, never ``assert``, so
``python -O`` cannot turn the checks off.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, compress
from operator import eq, not_

from kvpool.manager.core.block_pool import NULL_BLOCK, BlockPool
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
    holders = Counter(chain.from_iterable(req.blocks for req in pool.requests.values()))
    ref = pool.blocks.ref_cnt
    used = list(compress(range(len(ref)), ref))
    if holders != dict(zip(used, map(ref.__getitem__, used))):
        bad = next((b for b in set(holders) | set(used) if holders.get(b, 0) != ref[b]), None)
        raise CorruptState(f"{what}: block {bad}: ref_cnt {ref[bad] if bad is not None else '?'} but "
                           f"{holders.get(bad, 0)} request holdings")


def verify_blocks(bp: BlockPool, what: str = "pool") -> None:
    n, ref, bhash = bp.num_blocks, bp.ref_cnt, bp.block_hash
    if len(ref) != n or len(bhash) != n:
        raise CorruptState(f"{what}: {len(ref)} ref counts and {len(bhash)} hashes for {n} blocks")
    if ref[NULL_BLOCK] != 0 or bhash[NULL_BLOCK] is not None:
        raise CorruptState(f"{what}: the null block is in use or hashed")
    if min(ref) < 0:
        raise CorruptState(f"{what}: a negative ref_cnt (block {ref.index(min(ref))})")
    _verify_queue(bp, what)
    _verify_map(bp, what)


def _verify_queue(bp: BlockPool, what: str) -> None:
    """Free blocks are exactly those with ref_cnt 0 (block 0 aside), each queued once, and no
    unhashed block waits behind a hashed one."""
    order = bp.free_queue.order()
    queued = set(order)
    if len(queued) != len(order):
        raise CorruptState(f"{what}: a block is twice in the free queue")
    free = set(compress(range(len(bp.ref_cnt)), map(not_, bp.ref_cnt)))
    free.discard(NULL_BLOCK)
    if queued != free:
        diff = sorted(queued ^ free)[:5]
        raise CorruptState(f"{what}: free queue and ref counts disagree (blocks {diff}: queued without ref_cnt 0, "
                           "or free but not queued)")
    hashed = list(map(bool, map(bp.block_hash.__getitem__, order)))
    if True in hashed and False in hashed[hashed.index(True):]:
        raise CorruptState(f"{what}: an unhashed block is queued behind a hashed one")


def _verify_map(bp: BlockPool, what: str) -> None:
    """The map and its duplicates hold every hashed block once, each under its own hash."""
    bhash, cached, dups = bp.block_hash, bp.cached, bp._dups
    if not dups.keys() <= cached.keys() or not all(dups.values()):
        raise CorruptState(f"{what}: a duplicate list without a map entry, or an empty one")
    listed = list(chain(cached.values(), chain.from_iterable(dups.values())))
    keys = chain(cached.keys(), chain.from_iterable([h] * len(bs) for h, bs in dups.items()))
    if not all(map(eq, map(bhash.__getitem__, listed), keys)):
        raise CorruptState(f"{what}: a map entry points at a block without that hash")
    # Every listed block carries its (non-None) key: listed once each and as many as the hashed
    # blocks, they are exactly the hashed blocks.
    num_hashed = len(bhash) - bhash.count(None)
    if len(listed) != num_hashed or len(set(listed)) != len(listed):
        raise CorruptState(f"{what}: hash map and block hashes disagree ({len(listed)} entries and duplicates, "
                           f"{num_hashed} hashed blocks)")
