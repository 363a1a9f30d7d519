"""Pools sharing a node tier, in process (the manager's bookkeeping in the test process, the
bytes in real store files): a prefix one pool computed is loaded by another with the same greedy
output and fewer tokens computed; a load that does not verify is recomputed, never served."""

from __future__ import annotations

import os
import time

import pytest
from helpers.node_tier import node_engine, node_tier, settle
from helpers.worker import greedy, make_prompt, reference

from kvpool.shared.metrics import parse_text
from kvpool.shared.node_orders import Load
from kvpool.worker.metrics import WorkerMetrics


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_prefix_computed_by_one_pool_is_loaded_by_another(tmp_path, overlap):
    tier = node_tier(tmp_path, host_blocks=32)
    a, b = node_engine(tier, "a", overlap=overlap), node_engine(tier, "b", overlap=overlap)
    prompt = make_prompt(70, 1)  # 4 full blocks, the last token in the fifth
    want = reference(a, prompt, 8)
    assert a.generate([prompt], greedy(8)) == [[want]]
    settle(a)
    assert a.stats()["node_saves"]["host"] >= 4
    before = b.stats()["computed_tokens"]
    assert b.generate([prompt], greedy(8)) == [[want]]
    assert b.stats()["cached_tokens"] == 64  # 4 blocks from the node tier
    assert b.stats()["node_loads"]["host"] == 4
    assert b.bm.core.snapshot_stats()["node_hit_tokens"] == 64
    assert b.stats()["computed_tokens"] - before < 70
    settle(a, b)
    tier[0].check_invariants()
    assert not tier[0].batches  # every batch reported


def test_a_flipped_byte_is_recomputed_not_served(tmp_path):
    tier = node_tier(tmp_path, host_blocks=32)
    a, b = node_engine(tier, "a"), node_engine(tier, "b")
    prompt = make_prompt(70, 2)
    want = reference(a, prompt, 8)
    assert a.generate([prompt], greedy(8)) == [[want]]
    settle(a)
    hits = tier[0].lookup(_hashes(a, prompt))
    assert len(hits) == 4
    store = a.runner.node.host
    off = hits[1].slot * store.stride + 64 + 100
    store._bytes[off] ^= 0x40  # one byte of the second block
    assert b.generate([prompt], greedy(8)) == [[want]]
    s = b.stats()
    assert s["node_failures"] == {"mismatch": 1} and s["node_recomputed_tokens"] == 48  # blocks 1-3 again
    settle(a, b)
    assert tier[0].host.stats.verify_failures == 1
    assert len(tier[0].lookup(_hashes(a, prompt))) == 1  # the bad block left the tier; the chain stops there
    tier[0].check_invariants()


def test_without_the_check_a_flipped_byte_changes_the_output(tmp_path, monkeypatch):
    """The test above fails when a load's bytes are used unverified."""
    from kvpool.worker import node_store

    monkeypatch.setattr(node_store.HostStore, "_verify", lambda self, header, key, data: None)
    with pytest.raises(AssertionError):
        test_a_flipped_byte_is_recomputed_not_served(tmp_path)


@pytest.mark.timeout(120)  # a read waited on for ever hangs: fail instead
def test_a_disk_read_that_never_returns_is_recomputed_after_the_deadline(tmp_path):
    """A disk slot whose read blocks for ever (a FIFO nobody writes, as a hung mount blocks): the
    step gives up on it at the worker's node_tier_read_timeout, recomputes the block and the
    rest of the prefix behind it, reports the order late, and the output is the reference's."""
    tier = node_tier(tmp_path, host_blocks=32, disk_blocks=32, policy="write_through")
    a = node_engine(tier, "a")
    b = node_engine(tier, "b", node_tier_read_timeout=0.5)
    prompt = make_prompt(70, 4)
    want = reference(a, prompt, 8)
    assert a.generate([prompt], greedy(8)) == [[want]]
    settle(a)
    assert tier[0].evict("host", 10_000) >= 4  # the prefix is on disk only
    hashes = _hashes(a, prompt)
    assert b.runner.node.disk_io.timeout_s == 0.5  # the worker's setting
    fifo = b.runner.node.disk.path(tier[0].disk.blocks.cached[hashes[1]])
    fifo.unlink()
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that writes nothing: the read blocks
    try:
        assert b.generate([prompt], greedy(8)) == [[want]]
        s = b.stats()
        assert s["node_failures"] == {"deadline": 1, "prefetch_failed": 1}
        assert s["node_loads"] == {"host": 3, "disk": 3} and s["node_recomputed_tokens"] == 48
        settle(a, b)
        # reported late: the slot's hash left the disk level, counted as a deadline miss (the
        # prefetch behind it is the worker's own failure, never reported: the host level's load)
        assert (tier[0].disk.stats.deadline_misses, tier[0].disk.stats.verify_failures) == (1, 0)
        assert tier[0].host.stats.verify_failures == 0
        metrics = WorkerMetrics("b", "127.0.0.1", 0)  # and in the worker's Prometheus text
        try:
            got = parse_text(metrics.render(b, time.monotonic()))
        finally:
            metrics.close()
        assert got[("kvpool_worker_node_tier_failures_total", (("pool", "b"), ("reason", "deadline")))] == 1
        assert got[("kvpool_worker_node_tier_loads_total", (("level", "disk"), ("pool", "b")))] == 3
        assert got[("kvpool_worker_node_tier_recomputed_tokens_total", (("pool", "b"),))] == 48
        assert len(tier[0].lookup(hashes)) == 1
    finally:
        os.close(writer)  # the abandoned read returns (short) and frees its thread
    end = time.monotonic() + 20
    while b.runner.node.disk_io.late:
        assert time.monotonic() < end
        time.sleep(0.01)
    tier[0].check_invariants()
    assert not tier[0].batches


def _hashes(engine, prompt):
    from kvpool.worker.request import Request
    from kvpool.worker.sampler import SamplingParams

    req = Request(0, "x", 0, list(prompt), len(prompt), SamplingParams(), 0, engine.block_size)
    return list(req.hasher.hashes)


def test_loads_name_the_blocks_they_fill(tmp_path):
    tier = node_tier(tmp_path, host_blocks=32)
    a, b = node_engine(tier, "a"), node_engine(tier, "b")
    prompt = make_prompt(40, 3)
    a.generate([prompt], greedy(2))
    settle(a)
    b.add_request(prompt, greedy(2))
    results = b.bm.step([])  # nothing scheduled: no batch
    assert results == []
    plan = b.scheduler.schedule()
    res = b.bm.step(plan.ops)
    orders = res[0].node.pre
    assert [type(o) for o in orders] == [Load, Load] and [o.dst for o in orders] == res[0].blocks[:2]


def test_one_pool_moves_blocks_down_its_private_host_tier_into_the_node_tier(tmp_path):
    """A pool alone on its tier saves nothing eagerly: the device hands blocks to its private
    host tier, that tier hands what it drops to the node tier (read from the private host
    tensors before that tier's saves overwrite them), and a prefix gone from both comes back
    from the node tier with the reference's greedy output."""
    from helpers.worker import BLOCK_BYTES

    tier = node_tier(tmp_path, host_blocks=64)
    a = node_engine(tier, "a", device_blocks=12, host_kv_memory=8 * BLOCK_BYTES, max_model_len=96)
    prompts = [make_prompt(70, 10 + i) for i in range(6)]  # 4 full blocks each; 24 in all
    want = [reference(a, p, 4) for p in prompts]
    assert a.generate([prompts[0]], greedy(4)) == [[want[0]]]
    settle(a)
    assert tier[0].host.stats.saves == 0 and a.stats()["node_saves"]["host"] == 0  # nothing eager
    for p, w in zip(prompts[1:], want[1:]):
        assert a.generate([p], greedy(4)) == [[w]]
    settle(a)
    saved = a.stats()["node_saves"]["host"]
    assert saved >= 4 and tier[0].host.stats.saves == saved  # every one from the private host tier
    assert a.bm.core.host.blocks.cached.keys().isdisjoint(tier[0].host.blocks.cached.keys())
    before = a.stats()["node_loads"]["host"]
    assert a.generate([prompts[0]], greedy(4)) == [[want[0]]]  # gone from device and private host
    assert a.stats()["node_loads"]["host"] - before == 4 and a.stats()["node_failures"] == {}
    settle(a)
    tier[0].check_invariants()
    assert not tier[0].batches
