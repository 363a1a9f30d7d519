"""Tensor-parallel pools on the node tier, in process (ranks as threads, each rank's store a real
file): every rank keeps its slice of each block in its own store under one slot number, a prefix
one pool computed is loaded by another on both ranks, and a slice that does not verify on any one
rank is recomputed on all of them (the ranks agree: worker/tp.py ``NodeAgreement``)."""

from __future__ import annotations

import pytest
from helpers.node_tier import tp_node_tier
from helpers.tp import TPPair
from helpers.worker import greedy, make_engine, make_prompt

from kvpool.shared.hashing import HASH_BYTES
from kvpool.shared.node_orders import Load, Save
from kvpool.worker.request import Request
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.step_plan import Batch, BatchSeq
from kvpool.worker.tp import decode_plan, encode_plan


def hashes(engine, prompt: list[int]) -> list[bytes]:
    req = Request(0, "x", 0, list(prompt), len(prompt), SamplingParams(), 0, engine.block_size)
    return list(req.hasher.hashes)


def stores(pair: TPPair) -> list:
    """The host store of each rank of ``pair``, rank by rank."""
    return [pair.engine.runner.node.host] + [f.runner.node.host for f in pair.followers]


def run_out(pair: TPPair) -> None:
    while pair.engine.has_work():  # the node-tier reports too
        pair.engine.step()
    pair.settle()


@pytest.fixture
def two_pools(tmp_path):
    tier = tp_node_tier(tmp_path, host_blocks=32)
    pairs = [TPPair(64, node_tier=tier, pool=name) for name in ("a", "b")]
    try:
        yield tier, pairs
    finally:
        for p in pairs:
            p.close()


def test_each_rank_maps_its_own_store_of_one_tier(two_pools):
    (tier, info), (a, b) = two_pools
    assert info.world == 2 and len(set(info.stores)) == 2
    names = [s.layout.name for s in stores(a)]
    assert names == list(info.stores) == [s.layout.name for s in stores(b)]
    assert [s.path for s in stores(a)] == [s.path for s in stores(b)]  # the same files, shared
    assert stores(a)[0].layout.block_bytes * 2 == make_engine().spec.block_bytes  # half the heads each


def test_a_prefix_one_pool_computed_is_loaded_by_another_on_every_rank(two_pools):
    (tier, _), (a, b) = two_pools
    prompt = make_prompt(70, 1)  # 4 full blocks
    want = make_engine().generate([prompt], greedy(8))
    assert a.engine.generate([prompt], greedy(8)) == want
    run_out(a)
    hits = tier.lookup(hashes(a.engine, prompt))
    assert len(hits) == 4
    for store in stores(a):  # each rank's slice of every block, committed under the same slot
        for hit, key in zip(hits, hashes(a.engine, prompt), strict=False):
            block = store.layout.empty_block()
            assert store.read_into(hit.slot, key, block) is None
    before = b.engine.stats()["computed_tokens"]
    assert b.engine.generate([prompt], greedy(8)) == want
    run_out(b)
    s = b.engine.stats()
    assert s["cached_tokens"] == 64 and s["computed_tokens"] - before == 70 - 64 + 7
    assert s["node_loads"]["host"] == 4 == b.followers[0].runner.node.stats.loads["host"]
    tier.check_invariants()
    assert not tier.batches  # every batch reported, by rank 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_slice_that_fails_on_one_rank_is_recomputed_on_every_rank(two_pools, rank):
    (tier, _), (a, b) = two_pools
    prompt = make_prompt(70, 2)
    want = make_engine().generate([prompt], greedy(8))
    assert a.engine.generate([prompt], greedy(8)) == want
    run_out(a)
    hits = tier.lookup(hashes(a.engine, prompt))
    store = stores(a)[rank]
    store._bytes[hits[1].slot * store.stride + 64 + 100] ^= 0x40  # one byte of rank's slice of block 1
    assert b.engine.generate([prompt], greedy(8)) == want
    run_out(b)
    failures = [b.engine.runner.node.stats.failures, b.followers[0].runner.node.stats.failures]
    assert failures[rank] == {"mismatch": 1} and failures[1 - rank] == {}
    # both ranks moved the sequence back to block 1: rank 0 decided, the follower applied it
    assert b.engine.stats()["node_recomputed_tokens"] == 48
    assert b.followers[0].runner.node.stats.recomputed_tokens == 48
    assert tier.host.stats.verify_failures == 1  # the union, reported once
    assert len(tier.lookup(hashes(a.engine, prompt))) == 1  # the hash left the tier; the chain stops there
    tier.check_invariants()


def test_a_save_that_fails_on_one_rank_is_dropped_for_the_pool(two_pools, monkeypatch):
    (tier, _), (a, b) = two_pools
    prompt = make_prompt(70, 3)
    follower_store = stores(a)[1]
    real = type(follower_store).write

    def write(self, slot, key, block):
        if self is follower_store and key == hashes(a.engine, prompt)[2]:
            from kvpool.worker.node_layout import Failure
            return Failure("bad_slot", "this test's failed write")
        return real(self, slot, key, block)

    monkeypatch.setattr(type(follower_store), "write", write)
    want = make_engine().generate([prompt], greedy(8))
    assert a.engine.generate([prompt], greedy(8)) == want
    run_out(a)
    # block 2 saved on rank 0 only: the pool's save failed, so the tier keeps blocks 0-1
    assert len(tier.lookup(hashes(a.engine, prompt))) == 2
    assert b.engine.generate([prompt], greedy(8)) == want
    run_out(b)
    assert b.engine.stats()["node_loads"]["host"] == 2
    tier.check_invariants()


def test_the_plan_carries_its_node_orders_to_the_other_ranks():
    key = bytes(range(HASH_BYTES))
    plan = Batch([BatchSeq([5, 6], 16, [3, 4], True)], node_pre=[Load("host", 7, 3, key), Save("host", 2, 9, key)],
                 node_post=[Save("host", 4, 10, key), Save("disk", 10, 11, key)], node_batch=12)
    got = decode_plan(encode_plan(plan))
    assert (got.node_pre, got.node_post, got.node_batch) == (plan.node_pre, plan.node_post, 12)
    assert decode_plan(encode_plan(Batch([BatchSeq([1], 0, [1], True)]))).node_batch is None
