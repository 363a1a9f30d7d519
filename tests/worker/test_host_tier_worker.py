"""The worker with a host tier, under both policies (demote at eviction, write-through when a
block becomes full): greedy output still equals the contiguous reference when prefixes come back
from host memory by load, under save pressure, preemption and fork; and the K/V a load brings
back is exactly what was computed."""

from __future__ import annotations

import pytest
from helpers.worker import (
    BLOCK_BYTES,
    assert_drained,
    assert_load_restores_kv,
    evict_with_others,
    greedy,
    make_engine,
    make_prompt,
    reference,
)

from kvpool.worker.host_kv import HostCopier

POLICIES = pytest.mark.parametrize("policy", ["demote", "write_through"])


def tier_engine(device_blocks: int = 12, host_blocks: int = 64, policy: str = "demote", **cfg):
    cfg.setdefault("max_model_len", 128)
    return make_engine(max_blocks=device_blocks, host_kv_memory=host_blocks * BLOCK_BYTES, host_kv_policy=policy,
                       **cfg)


def copied_out(host) -> int:
    """Device -> host copies ordered, by demotion or write-through."""
    return host.stats.saves + host.stats.writes


@POLICIES
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_prefix_evicted_from_the_device_comes_back_by_load(overlap, policy):
    engine = tier_engine(overlap=overlap, policy=policy)
    a = make_prompt(50, 1)
    assert engine.generate([a], greedy(8)) == [[reference(engine, a, 8)]]
    evict_with_others(engine)
    host = engine.bm.core.host
    assert copied_out(host) > 0 and (host.stats.writes > 0) is (policy == "write_through")
    before = engine.stats()["cached_tokens"]
    assert engine.generate([a], greedy(8)) == [[reference(engine, a, 8)]]
    assert host.stats.loads > 0 and engine.stats()["cached_tokens"] - before == 48  # 3 full blocks
    assert_drained(engine)


@POLICIES
def test_without_the_copies_the_output_is_wrong(monkeypatch, policy):
    """The check above fails when the worker skips the host tier's copies."""
    real = HostCopier.run
    monkeypatch.setattr(HostCopier, "run", lambda self, saves, loads: real(self, saves, []))
    with pytest.raises(AssertionError):
        test_a_prefix_evicted_from_the_device_comes_back_by_load(False, policy)


@POLICIES
def test_without_settling_the_copies_never_land_and_the_output_is_wrong(monkeypatch, policy):
    """A step's saves and writes land in the host tensors at the next step's settle: skipping it
    loses them."""
    monkeypatch.setattr(HostCopier, "settle", lambda self: setattr(self, "in_flight", None))
    with pytest.raises(AssertionError):
        test_a_prefix_evicted_from_the_device_comes_back_by_load(False, policy)


def test_write_through_copies_after_the_forward_or_the_output_is_wrong(monkeypatch):
    """A write run before the forward (as a save is) copies K/V not computed yet."""
    from kvpool.worker.runner import ModelRunner

    real = ModelRunner.execute

    def writes_first(self, plan, *, sample=True):
        if plan.writes:
            self.host.write(plan.writes)  # gathers the device blocks now, before the forward
        plan.writes = []
        return real(self, plan, sample=sample)

    monkeypatch.setattr(ModelRunner, "execute", writes_first)
    with pytest.raises(AssertionError):
        test_a_prefix_evicted_from_the_device_comes_back_by_load(False, "write_through")


@POLICIES
def test_kv_after_a_save_and_load_round_trip_is_what_was_computed(policy):
    engine = tier_engine(overlap=False, policy=policy)
    assert_load_restores_kv(engine)


@POLICIES
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_preemption_and_saves_under_pressure(overlap, policy):
    engine = tier_engine(device_blocks=14, max_model_len=128, overlap=overlap, policy=policy)
    system = make_prompt(32, 30)
    prompts = [system + make_prompt(10 + i, 20 + i) for i in range(4)]
    outs = engine.generate(prompts, greedy(60))
    assert engine.stats()["preemptions"] > 0
    assert outs == [[reference(engine, p, 60)] for p in prompts]
    again = engine.generate(prompts[:2], greedy(20))
    assert again == [[reference(engine, p, 20)] for p in prompts[:2]]
    assert copied_out(engine.bm.core.host) > 0
    assert_drained(engine)


@POLICIES
def test_fork_with_a_prefix_loaded_from_the_host(policy):
    engine = tier_engine(policy=policy)
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
