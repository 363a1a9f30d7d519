"""scripts/bench_sched.py: both ways of knowing the held blocks schedule the very same steps (the
script exits otherwise), and each figure is reported (no timed assertions)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
bench_sched = importlib.import_module("bench_sched")


def test_counted_and_walked_schedule_the_same_steps_and_agree_on_the_peak():
    row = bench_sched.measure(24, 40, 7, seed=3)
    assert row["running"] == 24 and row["block_table_entries"] > 24
    for mode in bench_sched.MODES:
        assert len(row[mode]) == 2 and row[mode]["p50_us"] > 0
    assert row["walked_over_counted"] > 0


def test_the_walked_baseline_really_walks_and_counts_nothing(monkeypatch):
    d = bench_sched.driver(8, 10, walk=True, seed=1)
    calls = []
    walked = bench_sched.walked_held
    monkeypatch.setattr(bench_sched, "walked_held", lambda running: calls.append(1) or walked(running))
    d.step()
    assert calls and d.sched.requests.num_held == 0  # the count stayed off: the walk alone decided
    assert d.sched.stats.peak_blocks == walked(d.sched.running)


def test_another_checkouts_scheduler_runs_beside_this_one_on_the_same_steps():
    """--against: a copy of a checkout's worker/ (this one's here) under its own package name,
    its own classes, the same steps (measure exits when the modes diverge)."""
    against = bench_sched.load_checkout(str(Path(__file__).resolve().parents[2]))
    assert against[0].__module__ == "kvpool_against.scheduler"
    assert against[0] is not importlib.import_module("kvpool.worker.scheduler").Scheduler
    row = bench_sched.measure(16, 20, 5, seed=2, against=against)
    assert row["against"]["p50_us"] > 0 and row["against_over_counted"] > 0
