"""scripts/bench_tier.py: its configurations serve the same trace with identical greedy output,
and the copies it reports are the ones each policy orders (no timed assertions)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
bench_tier = importlib.import_module("bench_tier")


def test_every_configuration_reports_its_copies_and_the_same_output():
    prompts = bench_tier.trace(prefixes=4, prefix_blocks=3, rounds=2, vocab=500)
    plan = bench_tier.configs(device_blocks=10, set_blocks=12)
    assert set(plan) == {"device only", "demote", "write-through", "demote, small host", "write-through, small"}
    runs = {k: bench_tier.serve("tiny", prompts, 10, host, policy, 3) for k, (host, policy) in plan.items()}
    dev, dem, wt = runs["device only"], runs["demote"], runs["write-through"]
    assert all(r["outputs"] == dev["outputs"] for r in runs.values())
    assert dev["copies_per_step"] == 0 and dev["host_dup_blocks_max"] == 0
    assert dem["writes"] == 0 and dem["saves"] > 0 and dem["loads"] > 0
    assert wt["writes"] > 0 and wt["loads"] > 0
    for r in (dem, wt):
        assert r["hit_rate"] > dev["hit_rate"] and r["host_hit_rate"] > 0
        assert round(r["copies_per_step"] * r["steps"]) == r["saves"] + r["writes"] + r["loads"]
    assert wt["host_dup_blocks_max"] > 0  # write-through keeps device blocks in the host tier too


def test_the_stack_serves_the_trace_with_the_same_output_and_hits_by_level():
    tier_stack = importlib.import_module("tier_stack")
    prompts = tier_stack.stack_trace(prefixes=4, prefix_blocks=3, rounds=3, vocab=500)
    plan = tier_stack.stack_configs(device=8, set_blocks=12)
    runs = {k: tier_stack.serve_stack("tiny", prompts, 8, *levels, 3, bench_tier.run_waves) for k, levels in plan.items()}
    want = runs["device only"]["outputs"]
    assert all(r["outputs"] == want for r in runs.values())
    for r in runs.values():
        assert abs(r["device"] + r["host"] + r["node_host"] + r["node_disk"] - r["hit_rate"]) < 1e-9
        assert r["verify_failures"] == 0
    assert runs["device only"]["host"] == runs["device only"]["node_host"] == 0
    assert runs["+ disk"]["node_disk"] > 0 and runs["+ disk"]["hit_rate"] > runs["+ private host"]["hit_rate"]
    assert runs["+ disk"]["prompt_tokens_computed"] < runs["device only"]["prompt_tokens_computed"]


def test_a_second_pool_loads_the_prefix_the_first_computed():
    tier_stack = importlib.import_module("tier_stack")
    r = tier_stack.shared_ttft("tiny", 256, 1, 500)
    assert r["tokens_loaded"] == 256 and r["ttft_shared_s"] > 0 and r["ttft_recompute_s"] > 0
