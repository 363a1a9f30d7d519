"""The worker with a host tier: greedy output still equals the contiguous reference
when prefixes come back from host memory by load, under save pressure, preemption and fork; and
the K/V a load brings back is exactly what was saved."""

from __future__ import annotations

import pytest
import torch
from helpers.worker import BLOCK_BYTES, assert_drained, greedy, make_engine, make_prompt, reference

from kvpool.worker import runner


def tier_engine(device_blocks: int = 12, host_blocks: int = 64, **cfg):
    cfg.setdefault("max_model_len", 128)
    return make_engine(max_blocks=device_blocks, host_kv_memory=host_blocks * BLOCK_BYTES, **cfg)


def evict_with_others(engine, n: int = 4, seed: int = 100) -> None:
    engine.generate([make_prompt(48, seed + i) for i in range(n)], greedy(4))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_prefix_evicted_from_the_device_comes_back_by_load(overlap):
    engine = tier_engine(overlap=overlap)
    a = make_prompt(50, 1)
    assert engine.generate([a], greedy(8)) == [[reference(engine, a, 8)]]
    evict_with_others(engine)
    host = engine.bm.core.host
    assert host.stats.saves > 0
    before = engine.stats()["cached_tokens"]
    assert engine.generate([a], greedy(8)) == [[reference(engine, a, 8)]]
    assert host.stats.loads > 0 and engine.stats()["cached_tokens"] - before == 48  # 3 full blocks
    assert_drained(engine)


def test_without_the_loads_the_output_is_wrong(monkeypatch):
    """The check above fails when the worker skips the host tier's copies."""
    real = runner.copy_blocks_across
    monkeypatch.setattr(runner, "copy_blocks_across", lambda s, d, pairs: real(s, d, []))
    with pytest.raises(AssertionError):
        test_a_prefix_evicted_from_the_device_comes_back_by_load(False)


def test_kv_after_a_save_and_load_round_trip_is_what_was_computed():
    engine = tier_engine(overlap=False)
    a = make_prompt(50, 2)
    engine.add_request(a, greedy(2))
    engine.step()  # prefill: blocks 0..2 of a are full and cached
    table = list(engine.scheduler.running[0].block_table[:3])
    computed = [c[:, table].clone() for c in engine.runner.kv_caches]
    while engine.has_work():
        engine.step()
    evict_with_others(engine)
    engine.add_request(a, greedy(2))
    engine.step()
    new_table = list(engine.scheduler.running[0].block_table[:3])
    assert engine.bm.core.host.stats.loads > 0 and new_table != table
    for layer, cache in enumerate(engine.runner.kv_caches):
        assert torch.equal(cache[:, new_table], computed[layer])
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_preemption_and_saves_under_pressure(overlap):
    engine = tier_engine(device_blocks=14, max_model_len=128, overlap=overlap)
    system = make_prompt(32, 30)
    prompts = [system + make_prompt(10 + i, 20 + i) for i in range(4)]
    outs = engine.generate(prompts, greedy(60))
    assert engine.stats()["preemptions"] > 0
    assert outs == [[reference(engine, p, 60)] for p in prompts]
    again = engine.generate(prompts[:2], greedy(20))
    assert again == [[reference(engine, p, 20)] for p in prompts[:2]]
    assert engine.bm.core.host.stats.saves > 0
    assert_drained(engine)


def test_fork_with_a_prefix_loaded_from_the_host():
    engine = tier_engine()
    p = make_prompt(37, 8)  # a partial last block: shared by the samples, copied on write
    assert engine.generate([p], greedy(6)) == [[reference(engine, p, 6)]]
    evict_with_others(engine)
    outs = engine.generate([p], greedy(12, n=3))
    assert engine.bm.core.host.stats.loads > 0
    assert outs == [[reference(engine, p, 12)] * 3]
    assert_drained(engine)


def test_the_host_tier_is_accounted_in_host_memory():
    from kvpool.worker.config import WorkerConfig
    from kvpool.worker.profiler import KVMemoryError
    from kvpool.worker.startup import load_rank

    too_much = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=32 * BLOCK_BYTES,
                            host_kv_memory=1 << 55)
    with pytest.raises(KVMemoryError, match="--host-kv-memory"):
        load_rank(too_much)
    eats_budget = WorkerConfig(model="tiny", dtype="float32", device="cpu", cpu_memory_budget=64 << 20,
                               host_kv_memory=64 << 20)
    with pytest.raises(ValueError, match="cpu-memory-budget"):
        load_rank(eats_budget)
    _, kv_without = load_rank(WorkerConfig(model="tiny", dtype="float32", device="cpu", cpu_memory_budget=256 << 20))
    _, kv_with = load_rank(WorkerConfig(model="tiny", dtype="float32", device="cpu", cpu_memory_budget=256 << 20,
                                        host_kv_memory=64 << 20))
    assert kv_with < kv_without  # the profile's budget lost the host tier's share
