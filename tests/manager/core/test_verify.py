"""The bulk invariant check recovery runs (manager/core/verify.py): every kind of corruption is
caught with CorruptState (explicit raises: ``python -O`` keeps them), as the per-block check does."""

from __future__ import annotations

import pytest

from kvpool.manager.core import bulk
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.core.verify import verify_pool
from kvpool.shared.hashing import hash_blocks


def make_pool() -> Pool:
    """Requests 1 (3 blocks, 2 hashed) and 2 (shares 1's prefix); request 3 freed: cached and free."""
    pool = Pool(16, 4)
    hs = hash_blocks(list(range(12)), 4)
    pool.allocate(1, hs[:2], 10, 10)
    pool.allocate(2, hs[:2], 10, 10)
    pool.allocate(3, hash_blocks(list(range(50, 58)), 4), 8, 8)
    pool.free(3)
    pool.check_invariants()
    verify_pool(pool)
    return pool


def corrupt_ref(p: Pool) -> None:
    p.blocks.ref_cnt[p.requests[1].blocks[-1]] += 1


def queue_twice(p: Pool) -> None:
    p.blocks.free_queue._front.append(p.blocks.free_queue._front[0])


def free_but_unqueued(p: Pool) -> None:
    p.blocks.free_queue._front.pop()


def unhashed_behind_hashed(p: Pool) -> None:
    b = p.blocks.free_queue._front.pop()
    p.blocks.free_queue._lru.append(b)


def wrong_map_entry(p: Pool) -> None:
    h = next(iter(p.blocks.cached))
    p.blocks.cached[h] = p.requests[1].blocks[-1]


def untracked_duplicate(p: Pool) -> None:
    b = p.requests[1].blocks[-1]
    p.blocks.block_hash[b] = next(iter(p.blocks.cached))


def null_block_used(p: Pool) -> None:
    p.blocks.ref_cnt[0] = 1


def too_few_slots(p: Pool) -> None:
    p.requests[1].num_tokens = 100


@pytest.mark.parametrize("damage", [corrupt_ref, queue_twice, free_but_unqueued, unhashed_behind_hashed,
                                    wrong_map_entry, untracked_duplicate, null_block_used, too_few_slots])
@pytest.mark.parametrize("piece", [1, 2, bulk.PIECE])  # the bulk checks run in pieces: cut across them
def test_every_broken_invariant_is_caught(damage, piece, monkeypatch):
    monkeypatch.setattr(bulk, "PIECE", piece)
    pool = make_pool()
    damage(pool)
    with pytest.raises(AssertionError):
        pool.check_invariants()
    with pytest.raises(CorruptState):
        verify_pool(pool)


def test_a_block_id_out_of_range_is_corrupt_state_not_a_crash():
    pool = make_pool()
    pool.requests[1].blocks.append(10**6)
    with pytest.raises(CorruptState, match="malformed|ref_cnt"):
        verify_pool(pool)
