"""A pool with a host tier: reused cached blocks are saved first, a prefix found in the host tier
is loaded (and counts as cached), and run_step puts the orders into the sub-ops' results."""

from __future__ import annotations

from helpers.step_wire import run_wire_step

from kvpool.manager.core.pool import Pool
from kvpool.shared.hashing import hash_blocks

BS = 4


def chain(seed: int, n_blocks: int) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 1000 + i for i in range(n_blocks * BS + 1)]  # one token past the full blocks
    return tokens, hash_blocks(tokens, BS)


def alloc(req, hashes, prompt_len):
    return {"op": "alloc", "req": req, "hashes": hashes, "prompt_len": prompt_len, "max_new": prompt_len}


def test_without_a_host_tier_results_are_as_before():
    pool = Pool(8, BS)
    toks, hs = chain(1, 3)
    (res,) = run_wire_step(pool, "o", [alloc(1, hs, len(toks))])
    assert set(res) == {"ok", "cached", "blocks"} and pool.host is None


def test_a_reused_cached_block_is_saved_then_its_prefix_comes_back_by_load():
    pool = Pool(6, BS, host_blocks=8)  # 5 device blocks
    toks_a, ha = chain(1, 3)  # 3 full blocks + 1 token: 4 device blocks
    (ra,) = run_wire_step(pool, "o", [alloc("a", ha, len(toks_a))])
    run_wire_step(pool, "o", [{"op": "free", "req": "a"}])
    toks_b, hb = chain(2, 3)
    (rb,) = run_wire_step(pool, "o", [alloc("b", hb, len(toks_b))])  # needs 4: reuses a's cached blocks
    saved = {d for d, _ in rb["saves"]}
    assert saved and saved <= set(ra["blocks"][:3]) and rb["cached"] == 0
    run_wire_step(pool, "o", [{"op": "free", "req": "b"}])
    (ra2,) = run_wire_step(pool, "o", [alloc("a2", ha, len(toks_a))])
    assert ra2["cached"] == 3 * BS  # device hit + host loads: the whole prefix, nothing recomputed
    # b took 2 unhashed blocks and evicted 2 of a's (its tail first): those 2 come back by load
    assert len(rb["saves"]) == 2 and len(ra2["loads"]) == 2
    saved_hosts = {host for _, host in rb["saves"]}
    for host_block, dev in ra2["loads"]:
        assert dev in ra2["blocks"][1:3] and host_block in saved_hosts
    assert pool.host.stats.hit_tokens == 2 * BS
    pool.check_invariants()


def test_a_block_hashed_this_step_is_never_saved_and_pins_end_with_the_step():
    pool = Pool(5, BS, host_blocks=8)  # 4 device blocks
    toks_a, ha = chain(1, 3)
    toks_b, hb = chain(2, 3)
    # a is admitted and freed in the same step, then b reuses its blocks: their K/V was never
    # computed, so nothing may be saved from them
    res = run_wire_step(pool, "o", [alloc("a", ha, len(toks_a)), {"op": "free", "req": "a"},
                               alloc("b", hb, len(toks_b))])
    assert "saves" not in res[2] and pool.host.blocks.cached == {}
    assert pool.host.pinned == [] and not pool.fresh
    pool.check_invariants()


def test_stats_report_the_host_tier():
    pool = Pool(6, BS, host_blocks=8)
    stats = pool.snapshot_stats()
    assert stats["host_num_blocks"] == 8 and stats["host_cached_blocks"] == 0
    assert "host_num_blocks" not in Pool(6, BS).snapshot_stats()


def test_a_snapshot_keeps_the_host_tier_so_a_replay_orders_the_same_copies():
    from kvpool.manager.core.snapshot import dump_pool, load_pool

    pool = Pool(6, BS, host_blocks=8)
    toks_a, ha = chain(1, 3)
    toks_b, hb = chain(2, 3)
    run_wire_step(pool, "o", [alloc("a", ha, len(toks_a))])
    run_wire_step(pool, "o", [{"op": "free", "req": "a"}])
    run_wire_step(pool, "o", [alloc("b", hb, len(toks_b))])  # saves two of a's blocks
    run_wire_step(pool, "o", [{"op": "free", "req": "b"}])
    copy = load_pool(dump_pool(pool))
    assert copy.host is not None and copy.host.blocks.cached == pool.host.blocks.cached
    step = [alloc("a2", ha, len(toks_a))]
    replayed = run_wire_step(copy, "o", step)
    assert replayed == run_wire_step(pool, "o", step) and len(replayed[0]["loads"]) == 2
    copy.check_invariants()
    assert "host" not in dump_pool(Pool(6, BS))


def wt_pool(num_blocks: int) -> Pool:
    return Pool(num_blocks, BS, host_blocks=8, host_policy="write_through")


def test_write_through_writes_each_block_in_the_step_it_becomes_full_and_eviction_copies_nothing():
    pool = wt_pool(6)  # 5 device blocks
    toks_a, ha = chain(1, 3)
    (ra,) = run_wire_step(pool, "o", [alloc("a", ha, len(toks_a))])
    assert [d for d, _ in ra["writes"]] == ra["blocks"][:3] and "saves" not in ra
    assert pool.host.lookup(ha) == [host for _, host in ra["writes"]]  # readable from the next step
    run_wire_step(pool, "o", [{"op": "free", "req": "a"}])
    toks_b, hb = chain(2, 3)
    (rb,) = run_wire_step(pool, "o", [alloc("b", hb, len(toks_b))])  # reuses a's cached blocks
    assert "saves" not in rb and len(rb["writes"]) == 3  # a's hashes are in the host tier already
    run_wire_step(pool, "o", [{"op": "free", "req": "b"}])
    (ra2,) = run_wire_step(pool, "o", [alloc("a2", ha, len(toks_a))])
    assert ra2["cached"] == 3 * BS and len(ra2["loads"]) == 2 and "writes" not in ra2  # loaded: held
    s = pool.host.stats
    assert (s.writes, s.saves, s.saves_skipped) == (6, 0, 4)  # b evicted 2 of a, a2 2 of b: all held
    pool.check_invariants()


def test_a_write_through_whose_block_is_reused_in_the_same_step_is_withdrawn():
    pool = wt_pool(5)  # 4 device blocks
    toks_a, ha = chain(1, 3)
    toks_b, hb = chain(2, 3)
    res = run_wire_step(pool, "o", [alloc("a", ha, len(toks_a)), {"op": "free", "req": "a"},
                               alloc("b", hb, len(toks_b))])
    assert len(res[0]["writes"]) == 3 and "saves" not in res[2]
    assert set(pool.host.blocks.cached) == set(hb)  # a's writes read blocks b overwrites: dropped
    assert pool.host.stats.writes_withdrawn == 3 and not pool.host.writing
    pool.check_invariants()


def test_a_snapshot_keeps_the_policy():
    from kvpool.manager.core.snapshot import dump_pool, load_pool

    assert load_pool(dump_pool(wt_pool(6))).host.policy == "write_through"
    assert "policy" not in dump_pool(Pool(6, BS, host_blocks=8))["host"]  # the older layout
    assert wt_pool(6).snapshot_stats()["host_policy"] == "write_through"
