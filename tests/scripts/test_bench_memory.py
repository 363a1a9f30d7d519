"""scripts/bench_memory.py and scripts/memsim/: the allocator, the simulator's accounting and
structural facts, and the wiring of the end-to-end worker run.

Every simulation here runs with ``check=True``: after each step the written, reserved-unwritten
and free slots must add up to the pool, the written slots are recounted block by block, and the
real Pool's invariants are checked. No timed assertions.
"""

import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

# the scripts are not a package: put their folder on the path, as running one does
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
ms = importlib.import_module("memsim")
bench_memory = importlib.import_module("bench_memory")

TINY = ms.SimConfig(num_requests=60, budget_tokens=16384, max_model_len=4096, seed=3)


@pytest.fixture(scope="module")
def trace():
    return ms.make_trace(TINY)


@pytest.fixture(scope="module")
def results(trace):
    return {name: ms.simulate(TINY, trace, name, check=True) for name in ms.STRATEGIES}


def test_first_fit_reuses_the_first_hole_and_coalesces():
    heap = ms.FirstFit(100)
    assert [heap.alloc(n) for n in (10, 20, 30)] == [0, 10, 30]
    heap.release(10, 20)
    assert (heap.starts, heap.lens, heap.free) == ([10, 60], [20, 40], 60)
    assert heap.alloc(25) == 60  # the first hole is too small: first fit skips it
    assert heap.alloc(5) == 10
    heap.release(0, 10)  # merges with the hole after it: [0, 10) + [15, 30) are not adjacent
    assert (heap.starts, heap.lens) == ([0, 15, 85], [10, 15, 15])
    heap.release(10, 5)  # fills the gap: both neighbours merge
    assert (heap.starts, heap.lens, heap.free) == ([0, 85], [30, 15], 45)
    heap.release(30, 30)
    heap.release(60, 25)
    assert (heap.starts, heap.lens, heap.free) == ([0], [100], 100)
    assert heap.alloc(101) is None


def test_trace_is_seeded_and_shaped_as_configured(trace):
    assert ms.make_trace(TINY) == trace
    assert ms.make_trace(replace(TINY, seed=4)) != trace
    assert all(len(r.prompt) + max(r.out_lens) <= TINY.max_model_len for r in trace)
    ns = {len(r.out_lens) for r in trace}
    assert ns == {1, TINY.parallel_n}
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    burst = ms.make_trace(replace(TINY, arrival_rate=0.0))
    assert {r.arrival for r in burst} == {0}


def test_every_strategy_completes_every_sequence(results, trace):
    total = sum(sum(r.out_lens) for r in trace)
    for name, r in results.items():
        assert r["useful_decode_tokens"] == total, name
        assert r["decode_tokens"] >= total
        pct = r["written_pct"] + r["internal_waste_pct"] + r["free_pct"]
        assert pct == pytest.approx(100.0), name  # the per-step identity, averaged


def test_bytes_copied_only_by_doubling_and_copy_on_write(results):
    kvb, bs = TINY.kv_bytes_per_token, TINY.block_size
    assert results["static"]["bytes_copied"] == 0
    assert results["paged"]["bytes_copied"] == 0
    dbl, cow = results["doubling"], results["paged+prefix"]
    assert dbl["copies"] > 0 and dbl["bytes_copied"] > 0
    assert cow["copies"] > 0  # forked samples copy their shared partial prompt block
    assert cow["bytes_copied"] == cow["copies"] * bs * kvb
    assert cow["bytes_copied"] < dbl["bytes_copied"]


def test_waste_and_fragmentation_ordering(results):
    st, dbl, pg, pp = (results[n] for n in ("static", "doubling", "paged", "paged+prefix"))
    assert pp["internal_waste_pct"] < dbl["internal_waste_pct"] < st["internal_waste_pct"]
    assert pg["internal_waste_pct"] < dbl["internal_waste_pct"]
    assert pg["ext_frag_pct"] == pp["ext_frag_pct"] == 0.0
    assert st["ext_frag_pct"] == 0.0  # equal-sized regions leave no hole too small for the next one
    assert dbl["frag_refusals"] > 0  # enough free slots, no extent big enough
    # a paged sequence wastes less than one block: its partly written last block
    for r in (pg, pp):
        assert r["internal_waste_pct"] / 100 * TINY.budget_tokens < r["mean_seqs"] * TINY.block_size


def test_concurrency_ordering_and_static_bound(results):
    st, dbl, pg, pp = (results[n] for n in ("static", "doubling", "paged", "paged+prefix"))
    assert st["peak_seqs"] == TINY.budget_tokens // TINY.max_model_len
    assert st["preemptions"] == 0
    assert st["mean_requests"] < dbl["mean_requests"] < pg["mean_requests"] <= pp["mean_requests"]
    assert st["peak_requests"] < pg["peak_requests"] <= pp["peak_requests"]
    assert st["steps"] > dbl["steps"] > pg["steps"] >= pp["steps"]


def test_prefix_hits_only_with_prefix_caching(results):
    assert results["paged+prefix"]["prefix_hit_rate"] > 0.2
    for name in ("static", "doubling", "paged"):
        assert results[name]["prefix_hit_rate"] == 0.0


def test_the_host_tier_keeps_prefix_hits_beyond_the_device_budget_and_changes_no_device_metric(results):
    pp, ph = results["paged+prefix"], results["paged+host"]
    assert ph["prefix_hit_rate"] > pp["prefix_hit_rate"] and ph["host_hit_rate"] > 0
    assert ph["prefix_hit_rate"] - ph["host_hit_rate"] <= pp["prefix_hit_rate"]  # device hits: no more
    assert ph["host_bytes_copied"] > 0 and pp["host_bytes_copied"] == 0
    # the sim charges nothing for prefill, and loaded blocks take device blocks like computed ones
    for key in ("steps", "peak_requests", "mean_requests", "written_pct", "internal_waste_pct", "preemptions"):
        assert ph[key] == pp[key], key
    off = ms.simulate(replace(TINY, host_budget_x=0.0), ms.make_trace(TINY), "paged+host")
    assert off["prefix_hit_rate"] == pp["prefix_hit_rate"] and off["host_bytes_copied"] == 0


@pytest.mark.parametrize("name", ms.STRATEGIES)
def test_growth_past_the_pool_preempts_newest_and_still_finishes(name):
    # 8 short prompts fit at once; after 500 steps their 20 samples need > 8192 slots even with
    # shared prompts, so growing strategies must preempt (static admits 4 sequences, never does)
    cfg = replace(TINY, budget_tokens=8192, max_model_len=2048, system_max=1000, arrival_rate=0.0)
    trace = [ms.TraceRequest(i, 0, tuple(range(i, i + 100)), (1500,) if i % 2 else (500,) * 4)
             for i in range(8)]
    r = ms.simulate(cfg, trace, name, check=True)
    assert r["useful_decode_tokens"] == 4 * 1500 + 4 * 4 * 500
    if name == "static":
        assert r["preemptions"] == 0 and r["peak_seqs"] == 4
    else:
        assert r["preemptions"] > 0 and r["discarded_tokens"] > 0
        assert r["decode_tokens"] > r["useful_decode_tokens"]


def test_block_size_sweep_trades_waste_for_table_size(trace):
    rows = ms.sweep_block_sizes(TINY, trace, sizes=(8, 32, 128))
    entries = [r["block_table_entries_per_seq"] for r in rows]
    assert entries[0] > entries[1] > entries[2]
    assert [r["block_table_width"] for r in rows] == [512, 128, 32]
    assert rows[0]["internal_waste_pct"] < rows[2]["internal_waste_pct"]


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="raise --budget-tokens"):
        ms.SimConfig(budget_tokens=8192, max_model_len=4096)
    with pytest.raises(ValueError, match="multiple of block_size"):
        ms.SimConfig(budget_tokens=65536 + 8, block_size=16)
    with pytest.raises(ValueError, match="host_budget_x"):
        ms.SimConfig(host_budget_x=-1)
    with pytest.raises(ValueError, match="unknown strategy"):
        ms.make_strategy("buddy", TINY)


def test_main_writes_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report = bench_memory.main(["--quick", "--requests", "40", "--out", str(tmp_path)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["bench_memory.json", "block_size.png", "concurrency.png", "waste.png"]
    assert set(report["strategies"]) == set(ms.STRATEGIES)
    assert [r["block_size"] for r in report["sweep"]] == list(ms.SWEEP_BLOCK_SIZES)
    out = capsys.readouterr().out
    assert "paged+prefix" in out and "target:" in out


def test_a_request_that_cannot_grow_alone_is_an_error_not_a_livelock():
    # doubling keeps the old region while copying: four samples at 2048 slots cannot all reach 4096
    # in 4 * 4096 slots (the last reallocation needs 3 * 4096 + 2048 + 4096)
    cfg = replace(TINY, budget_tokens=4 * 4096)
    trace = [ms.TraceRequest(0, 0, tuple(range(1500)), (2500,) * 4)]
    with pytest.raises(RuntimeError, match="raise --budget-tokens"):
        ms.simulate(cfg, trace, "doubling")
    assert ms.simulate(cfg, trace, "paged", check=True)["preemptions"] == 0


def test_e2e_only_runs_every_worker_mode_and_keeps_the_sim_results(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "bench_memory.json").write_text(json.dumps({"strategies": {"static": {"steps": 1}}}))
    report = bench_memory.main(["--quick", "--e2e-only", "--out", str(tmp_path)])  # tiny model, seconds
    assert report["strategies"] == {"static": {"steps": 1}}  # the simulator results already there
    assert json.loads((tmp_path / "bench_memory.json").read_text()) == report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_memory.json", "e2e.png"]
    e2e = report["end_to_end"]
    res = e2e["strategies"]
    assert list(res) == ["static", "paged", "paged+prefix"] and "doubling" in e2e["not_measured"]
    assert e2e["ratios"]["static"] == 1.0
    assert len({r["tokens"] for r in res.values()}) == 1  # every mode generates the whole trace
    assert len({r["kv_bytes"] for r in res.values()}) == 1  # at one KV budget
    a = e2e["args"]
    assert res["static"]["peak_running"] <= (a["kv_blocks"] - 1) // (a["max_model_len"] // a["block_size"])
    assert res["static"]["peak_running"] < res["paged"]["peak_running"]
    assert res["static"]["prefix_hit_rate"] == res["paged"]["prefix_hit_rate"] == 0.0
    assert res["paged+prefix"]["prefix_hit_rate"] > 0.0
    assert e2e["command"].startswith("python scripts/bench_worker.py --modes static,paged,paged+prefix")
    out = capsys.readouterr().out
    assert "ratio:" in out and "doubling: not measured" in out
