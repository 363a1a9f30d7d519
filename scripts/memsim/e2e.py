"""Tokens/s of the real worker at one KV budget, per strategy (bench_worker.py).

The simulator counts memory; this runs scripts/bench_worker.py (model, scheduler, in-process
manager, paged attention) in its three modes on one trace whose prompts partly start with shared
system prompts, so that prefix caching has something to share. Its sizes are its own: a small
model on CPU, one thread, with a KV budget that holds 4 max_model_len requests, so static's batch
is set by the budget and not by max_num_seqs; two rounds over the modes, each keeping its fastest
run, so that a busy neighbour on a shared machine does not decide a ratio. Doubling has no real
worker.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .report import COLORS, _save
from .sim import STRATEGIES

PLOTTED = tuple(n for n in STRATEGIES if n != "paged+host")  # the tier's real-worker run: scripts/bench_tier.py

E2E_FLAGS = {"--modes": "static,paged,paged+prefix", "--model": "small", "--requests": "16",
             "--min-prompt": "64", "--max-prompt": "320", "--shared-fraction": "0.4",
             "--shared-prefixes": "4", "--shared-prefix-len": "192", "--min-output": "64",
             "--max-output": "384", "--max-model-len": "1024", "--kv-blocks": "261", "--threads": "1",
             "--repeats": "2"}
# --kv-blocks: 4 max_model_len requests (4 * 64 blocks) + the null block + 4 blocks. The worker's
# admission keeps one block of growth per running request even under static preallocation,
# which never grows; without the 4 blocks static would run 3 requests, not the 4 its memory holds.
E2E_QUICK = {"--model": "tiny", "--requests": "8", "--min-output": "8", "--max-output": "24",
             "--shared-prefixes": "1", "--repeats": "1"}  # seconds: for tests of the wiring
NO_WORKER = {"doubling": "no real worker: the worker's KV cache is paged; contiguous regions that "
                         "double exist only in the simulator"}


def end_to_end(seed: int, overrides: dict[str, str] | None = None, log=print) -> dict:
    """Every worker mode on the shared-prompt trace: the report's "end_to_end" section."""
    import bench_worker  # scripts/ is on sys.path; imported here so the simulator needs no torch

    flags = {**E2E_FLAGS, **(overrides or {}), "--seed": str(seed)}
    argv = [x for flag_value in flags.items() for x in flag_value]
    args = bench_worker.parser().parse_args(argv)
    res = bench_worker.measure(args, log, progress=True)
    return {"command": "python scripts/bench_worker.py " + " ".join(argv),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "strategies": res["modes"], "ratios": res["ratios"], "not_measured": NO_WORKER}


def print_e2e(e2e: dict) -> None:
    import bench_worker

    print("end to end, the real worker at one KV budget:", e2e["command"])
    bench_worker.print_results(argparse.Namespace(**e2e["args"]), {"modes": e2e["strategies"],
                                                                   "ratios": e2e["ratios"]})
    res = e2e["strategies"]
    base = res["static"]["tokens_per_cpu_s"]
    print("  per CPU-second, which a busy machine inflates less than wall time: " + ", ".join(
        f"{m} {r['tokens_per_cpu_s']:.1f} tokens ({r['tokens_per_cpu_s'] / base:.2f}x)" for m, r in res.items()))
    for name, why in e2e["not_measured"].items():
        print(f"  {name}: not measured, {why}")


def plot_e2e(e2e: dict, out: Path) -> Path:
    """Writes e2e.png: tokens/s per strategy, labelled with the ratio against static."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, a = e2e["strategies"], e2e["args"]
    fig, ax = plt.subplots(figsize=(7, 4))
    top = max(r["tokens_per_s"] for r in res.values())
    for i, name in enumerate(PLOTTED):
        if name not in res:
            ax.text(i, 0.03 * top, "no real\nworker", ha="center", va="bottom", fontsize=8, color="#7f7f7f")
            continue
        r = res[name]
        ax.bar(i, r["tokens_per_s"], 0.6, color=COLORS[name])
        ax.text(i, r["tokens_per_s"], f"{e2e['ratios'][name]:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(PLOTTED)), [_label(n, res.get(n)) for n in PLOTTED], fontsize=8)
    kv_mib = res["static"]["kv_bytes"] / 2**20
    ax.set(ylabel="generated tokens/s", ylim=(0, 1.15 * top),
           title=f"Real worker, one KV budget ({kv_mib:.1f} MiB, {a['kv_blocks']} blocks), model {a['model']} "
                 f"on {a['device']}; x = vs static")
    ax.title.set_fontsize(10)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out / "e2e.png")


def _label(name: str, r: dict | None) -> str:
    if r is None:
        return name
    hits = f"\n{r['prefix_hit_rate']:.0%} prefix hits" if name == "paged+prefix" else ""
    return f"{name}\npeak {r['peak_running']} running{hits}"
