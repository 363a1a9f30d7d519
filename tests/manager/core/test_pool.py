"""Exact scenario tests of the block-pool core: block ids, eviction order, all-or-nothing."""

import copy

import pytest

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.manager.core.pool import Pool, PoolError
from kvpool.shared.hashing import hash_blocks

BS = 4


def make_pool(num_blocks=11, events=False):
    return Pool(num_blocks, BS, enable_events=events)


def alloc(pool, rid, tokens, max_new=None, lookahead=0, salt=None):
    hashes = hash_blocks(tokens, BS, cache_salt=salt)
    res = pool.allocate(rid, hashes, len(tokens), max_new or len(tokens), lookahead)
    pool.check_invariants()
    return res


def state(pool):
    bp = pool.blocks
    reqs = {k: (list(r.blocks), r.num_tokens, list(r.hashes), r.num_cached) for k, r in pool.requests.items()}
    return (list(bp.ref_cnt), list(bp.block_hash), bp.free_queue.order(), dict(bp.cached),
            copy.deepcopy(bp._dups), reqs)


def test_first_allocation_takes_blocks_in_order():
    pool = make_pool()
    assert alloc(pool, "a", list(range(10))) == (0, [1, 2, 3])
    assert pool.blocks.free_queue.order() == [4, 5, 6, 7, 8, 9, 10]
    assert len(pool.blocks.cached) == 2  # two full blocks; the partial third has no hash


def test_free_order_unhashed_front_hashed_back_tail_first():
    pool = make_pool()
    alloc(pool, "a", list(range(10)))
    pool.free("a")
    pool.check_invariants()
    # partial block 3 (no hash) goes to the front; hashed 2 then 1 to the back (tail first)
    assert pool.blocks.free_queue.order() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]


def test_hit_after_free_revives_blocks_out_of_the_queue():
    pool = make_pool()
    alloc(pool, "a", list(range(10)))
    pool.free("a")
    assert alloc(pool, "b", list(range(10))) == (8, [1, 2, 3])
    assert pool.blocks.free_queue.order() == [4, 5, 6, 7, 8, 9, 10]
    assert pool.snapshot_stats()["hit_tokens"] == 8


def test_block_of_last_prompt_token_is_recomputed_and_duplicates_tracked():
    pool = make_pool()
    alloc(pool, "a", list(range(8)))  # two full blocks, both cached
    # b has the same 8 tokens: only block 0 may hit; block 1 holds the last prompt token
    assert alloc(pool, "b", list(range(8))) == (4, [1, 3])
    h1 = hash_blocks(list(range(8)), BS)[1]
    assert pool.blocks.cached[h1] == 2 and pool.blocks._dups[h1] == [3]
    pool.free("a")
    # evicting block 2 hands the map entry over to its duplicate, block 3
    assert pool.evict(1) == 1
    pool.check_invariants()
    assert pool.blocks.cached[h1] == 3 and h1 not in pool.blocks._dups
    assert pool.lookup(hash_blocks(list(range(8)), BS)) == 2


def test_allocation_never_evicts_its_own_hits_and_chain_evicted_from_its_end():
    pool = make_pool(num_blocks=5)  # 4 usable blocks
    a, c = list(range(8)), list(range(100, 108))
    assert alloc(pool, "a", a) == (0, [1, 2])
    assert alloc(pool, "c", c) == (0, [3, 4])
    pool.free("a")
    pool.free("c")
    assert pool.blocks.free_queue.order() == [2, 1, 4, 3]
    b = a + [7, 7, 7, 7]
    # hits 1 and 2 sit at the LRU front, yet the new block evicts c's tail block 4
    assert alloc(pool, "b", b) == (8, [1, 2, 4])
    assert pool.lookup(hash_blocks(c, BS)) == 1, "c's chain loses its end, keeps its head"
    assert pool.blocks.block_hash[4] == hash_blocks(b, BS)[2], "a reused block gets its new hash"


def test_salt_isolates_tenants():
    pool = make_pool()
    alloc(pool, "a", list(range(12)), salt="tenant-a")
    assert alloc(pool, "b", list(range(12)), salt="tenant-b")[0] == 0
    assert alloc(pool, "c", list(range(12)), salt="tenant-a")[0] == 8


def test_lookahead_reserves_extra_slots():
    pool = make_pool()
    assert alloc(pool, "a", list(range(5)), lookahead=3) == (0, [1, 2])
    assert alloc(pool, "b", list(range(50, 55)), lookahead=4) == (0, [3, 4, 5])


def test_chunked_prefill_and_decode_extend():
    pool = make_pool()
    tokens = list(range(10))
    assert alloc(pool, "a", tokens, max_new=3) == (0, [1])
    assert pool.blocks.cached == {}, "no block is full after 3 tokens"
    assert pool.extend("a", 9) == ([2, 3], [])
    assert len(pool.blocks.cached) == 2
    assert pool.extend("a", 10) == ([], [])
    assert pool.extend("a", 13, hash_blocks(tokens + [1, 2, 3], BS)[2:]) == ([4], [])
    assert len(pool.blocks.cached) == 3
    pool.check_invariants()


def test_no_space_changes_nothing():
    pool = make_pool(num_blocks=6)  # 5 usable
    alloc(pool, "a", list(range(8)))
    pool.free("a")  # blocks 1, 2 cached and free
    alloc(pool, "x", list(range(200, 208)))  # blocks 3, 4 in use
    before = state(pool)
    # would hit 1 block, needs 4 more, only 3 - 1 left after reviving the hit
    assert alloc(pool, "b", list(range(8)) + list(range(300, 312))) is None
    assert state(pool) == before
    assert pool.extend("x", 30) is None
    assert state(pool) == before
    assert pool.snapshot_stats()["no_space"] == 2


def test_reset_refused_while_in_use():
    pool = make_pool(events=True)
    alloc(pool, "a", list(range(8)))
    assert pool.reset_prefix_cache() is False
    pool.free("a")
    assert pool.reset_prefix_cache() is True
    pool.check_invariants()
    assert pool.blocks.cached == {} and pool.lookup(hash_blocks(list(range(8)), BS)) == 0
    assert pool.blocks.free_queue.num_hashed() == 0
    assert pool.take_events()[-1] == AllBlocksCleared()


def test_fork_copy_on_write_of_shared_partial_block():
    pool = make_pool()
    assert alloc(pool, "p", list(range(6)), lookahead=4) == (0, [1, 2, 3])
    assert pool.fork("p", "c") == [1, 2], "the child does not share empty lookahead blocks"
    assert pool.blocks.ref_cnt[1:4] == [2, 2, 1]
    # the child writes token 6 into the shared partial block 2: copy it first
    assert pool.extend("c", 7) == ([], [(1, 2, 4)])
    assert pool.requests["c"].blocks == [1, 4]
    assert pool.blocks.ref_cnt[2] == 1
    assert pool.extend("p", 7) == ([], []), "the parent now owns block 2 alone"
    assert pool.extend("c", 9) == ([5], [])
    pool.check_invariants()
    pool.free("p")
    pool.free("c")
    pool.check_invariants()
    assert pool.blocks.num_used == 0


def test_fork_at_block_boundary_needs_no_copy():
    pool = make_pool()
    alloc(pool, "p", list(range(8)))
    pool.fork("p", "c")
    assert pool.extend("c", 9) == ([3], [])
    assert pool.extend("p", 9) == ([4], [])


def test_evict_lru_first_and_events():
    pool = make_pool(events=True)
    alloc(pool, "a", list(range(8)))
    alloc(pool, "b", list(range(50, 58)))
    pool.free("a")
    pool.free("b")
    ha, hb = hash_blocks(list(range(8)), BS), hash_blocks(list(range(50, 58)), BS)
    assert pool.evict(3) == 3
    pool.check_invariants()
    assert pool.lookup(hb) == 1 and pool.lookup(ha) == 0
    ev = pool.take_events()
    assert ev[0] == BlockStored(ha, None) and ev[1] == BlockStored(hb, None)
    assert ev[2:] == [BlockRemoved([ha[1]]), BlockRemoved([ha[0]]), BlockRemoved([hb[1]])]
    # evicted blocks are unhashed now and reused first
    assert pool.blocks.free_queue.order()[:3] == [4, 1, 2]


def test_bad_input_raises_and_changes_nothing():
    pool = make_pool()
    alloc(pool, "a", list(range(8)))
    before = state(pool)
    with pytest.raises(PoolError) as e:
        alloc(pool, "a", list(range(8)))
    assert e.value.code == "duplicate_request"
    with pytest.raises(PoolError):
        pool.free("nope")
    with pytest.raises(PoolError):
        pool.extend("a", 3)  # shrinking
    with pytest.raises(PoolError):
        pool.allocate("z", [], 0, 1)
    with pytest.raises(PoolError):
        pool.allocate("z", hash_blocks(list(range(8)), BS), 5, 5)  # more hashes than full blocks
    with pytest.raises(PoolError):
        pool.fork("a", "a")
    assert state(pool) == before


def test_caching_disabled_never_hits():
    pool = Pool(11, BS, enable_caching=False)
    pool.allocate("a", hash_blocks(list(range(8)), BS), 8, 8)
    pool.free("a")
    assert pool.allocate("b", hash_blocks(list(range(8)), BS), 8, 8)[0] == 0
    pool.check_invariants()


@pytest.mark.parametrize("events", [False, True])
def test_a_hash_repeated_within_one_allocation_is_a_duplicate_of_its_first_block(events):
    """Bad input (a chain cannot repeat a hash) that the map still records exactly: the first
    block holds the entry, the second is its duplicate; evicting them leaves no stale entry."""
    pool = make_pool(num_blocks=6, events=events)
    h = hash_blocks([7] * BS, BS)[0]
    assert pool.allocate("a", [h, h], 2 * BS + 1, 2 * BS + 1) == (0, [1, 2, 3])
    pool.check_invariants()
    assert pool.blocks.cached == {h: 1}
    assert pool.blocks.duplicates() == {h: [2]}
    if events:
        assert pool.take_events() == [BlockStored([h], None)]
    pool.free("a")
    assert alloc(pool, "b", list(range(5 * BS))) == (0, [3, 4, 5, 2, 1])  # evicts both holders
    assert h not in pool.blocks.cached and not pool.blocks.duplicates()
    if events:
        assert pool.take_events()[0] == BlockRemoved([h])


def test_a_free_with_computed_drops_the_hashes_of_blocks_never_computed():
    """A client that was answered for a step its request never ran (preempted or finished
    first, with overlap) frees it with ``computed``: blocks past those tokens lose their hash,
    and go back unhashed, so no later hit reads K/V nobody wrote."""
    pool = make_pool(events=True)
    toks = list(range(100, 117))  # 4 full blocks and one token
    _, blocks = alloc(pool, "a", toks, max_new=8)  # step 1 computes 8 tokens: blocks 0, 1 hashed
    pool.extend("a", 17, [], 0)  # step 2, answered: blocks 2, 3 hashed, never computed
    assert pool.requests["a"].num_cached == 4
    pool.take_events()
    pool.free("a", computed=8)
    pool.check_invariants()
    assert pool.take_events() == [BlockRemoved([hash_blocks(toks, BS)[2]]), BlockRemoved([hash_blocks(toks, BS)[3]])]
    cached, _ = alloc(pool, "b", toks)
    assert cached == 8  # the two computed blocks only
    pool.free("b", computed=17)  # everything computed: nothing dropped
    assert len(pool.blocks.cached) == 4
    pool.check_invariants()


def test_a_free_without_computed_or_past_the_cached_blocks_keeps_the_cache():
    pool = make_pool()
    toks = list(range(200, 217))
    alloc(pool, "a", toks)
    pool.free("a")
    assert len(pool.blocks.cached) == 4
    alloc(pool, "b", toks)
    pool.free("b", computed=16)
    assert len(pool.blocks.cached) == 4
    pool.check_invariants()


def test_write_through_copies_of_uncomputed_blocks_are_dropped_from_the_host_tier_too():
    pool = Pool(11, BS, host_blocks=8, host_policy="write_through")
    toks = list(range(300, 317))
    hashes = hash_blocks(toks, BS)
    pool.allocate("a", hashes, 17, 8)
    pool.take_copies()
    pool.end_step()
    pool.extend("a", 17, [], 0)
    assert [c.src for c in pool.take_copies()[2]] == pool.requests["a"].blocks[2:4]  # written after the forward
    pool.end_step()  # the client's update preempts "a": that forward never ran for it
    pool.free("a", computed=8)
    pool.check_invariants()
    assert set(pool.host.blocks.cached) == set(hashes[:2]) and set(pool.blocks.cached) == set(hashes[:2])


@pytest.mark.parametrize("bad", [-1, "8", 1.5, 1 << 31])
def test_a_bad_computed_is_a_bad_field_and_frees_nothing(bad):
    from helpers.step_wire import run_wire_step

    pool = make_pool()
    alloc(pool, (None, 1), list(range(9)))
    (res,) = run_wire_step(pool, None, [{"op": "free", "req": 1, "computed": bad}])
    assert res["code"] == "bad_field" and "computed" in res["msg"] and (None, 1) in pool.requests


def test_a_request_refused_for_space_is_counted_in_the_hit_rate_once_at_admission():
    """As vLLM 0.33's scheduler records prefix-cache stats: at admission, never per refusal."""
    pool = make_pool(num_blocks=5)  # 4 usable blocks
    shared = list(range(8))  # two full blocks
    assert alloc(pool, "a", shared + [100, 101]) == (0, [1, 2, 3])
    pool.free("a")
    assert alloc(pool, "hog", [50] * 4) is not None  # holds one block: 3 left, 2 of them cached
    for _ in range(3):  # needs 2 hits + 2 new blocks, and only 1 block is uncached
        assert alloc(pool, "b", shared + [7] * 8) is None
    s = pool.snapshot_stats()
    assert (s["lookup_tokens"], s["hit_tokens"], s["no_space"]) == (14, 0, 3)
    pool.free("hog")
    assert alloc(pool, "b", shared + [7] * 8) == (8, [1, 2, 4, 3])  # 3: the hog's block, evicted
    s = pool.snapshot_stats()
    assert (s["lookup_tokens"], s["hit_tokens"]) == (30, 8)
    assert s["prefix_hit_rate"] == pytest.approx(8 / 30)


def test_a_negative_lookahead_is_named_in_the_refusal():
    pool = make_pool()
    alloc(pool, "a", list(range(16)))
    with pytest.raises(PoolError, match="lookahead must be >= 0, got -1"):
        pool.extend("a", 16, lookahead=-1)
    with pytest.raises(PoolError, match="num_tokens 15 < current 16"):
        pool.extend("a", 15)
