#!/usr/bin/env python3
"""Paged KV memory against static max_model_len preallocation, at the same KV memory budget.

Every mode uses the same model, weights, scheduler, manager (in-process) and paged-attention path,
and the same KV budget (``--kv-blocks``):

  static         reserves ``max_model_len`` slots for every request at admission and shares
                 nothing, as engines without paging do (static_prealloc, prefix caching off).
  paged          blocks on demand, prefix caching off.
  paged+prefix   blocks on demand, prefix caching on: requests that share a prompt prefix
                 (``--shared-fraction``) hold its blocks once and skip its prefill.

On a mixed-length trace the paged worker holds more requests at once, so its decode batches are
larger. Every request is submitted at t=0. The modes run interleaved, one engine step of each in
turn, so load from elsewhere on the machine falls on all of them alike; tokens/s is a mode's
generated tokens over the time of its own steps, and each mode is reported as a ratio against
static, measured in the same run. A progress bar (stderr) counts the tokens of every mode.
Prompts come from the reference trace generator (bench/trace.py), output lengths from the same
seed.

    .venv/bin/python scripts/bench_worker.py             # static and paged, small preset, CPU
    .venv/bin/python scripts/bench_worker.py --model tiny --requests 64 --json
    .venv/bin/python scripts/bench_worker.py --modes static,paged,paged+prefix --shared-fraction 0.4
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
from tqdm import tqdm

from kvpool.bench.trace import TraceConfig, prompts
from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.profiler import page_bytes
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.startup import build_engine

MODES = ("static", "paged", "paged+prefix")


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    cfg = TraceConfig(num_requests=args.requests, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                      vocab_size=vocab, shared_fraction=args.shared_fraction,
                      num_shared_prefixes=args.shared_prefixes, shared_prefix_len=args.shared_prefix_len,
                      seed=args.seed)
    rng = random.Random(args.seed)
    return [(p, rng.randint(args.min_output, args.max_output)) for p in prompts(cfg)]


class ModeRun:
    """One mode's engine with the whole trace submitted; ``step`` times its own steps only."""

    def __init__(self, args: argparse.Namespace, mode: str, trace: list[tuple[list[int], int]]) -> None:
        model = PRESETS[args.model]
        self.block_bytes = page_bytes(args.block_size, model.num_kv_heads, model.head_size,
                                      torch.float32) * model.num_layers
        self.kv_bytes = args.kv_blocks * self.block_bytes
        cfg = WorkerConfig(model=args.model, dtype="float32", device=args.device, block_size=args.block_size,
                           max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=self.kv_bytes,
                           static_prealloc=mode == "static", enable_prefix_caching=mode == "paged+prefix",
                           seed=args.seed)
        self.mode = mode
        self.engine = build_engine(cfg, LocalBlockManager("bench"))
        # the warm-up prompt is in no trace, so it leaves nothing in the prefix cache the trace could hit
        warm = [(7 * i + 3) % model.vocab_size for i in range(len(trace[0][0]))]
        self.engine.generate([warm], SamplingParams(max_tokens=2, ignore_eos=True))
        self.engine.scheduler.stats.__init__()
        for prompt, out_len in trace:
            self.engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
        self.tokens, self.elapsed, self.cpu = 0, 0.0, 0.0

    def step(self) -> int:
        t0, c0 = time.perf_counter(), time.process_time()
        new = sum(ev.token is not None for ev in self.engine.step())
        self.elapsed += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        self.tokens += new
        return new

    def result(self) -> dict:
        s = self.engine.stats()
        return {"mode": self.mode, "tokens": self.tokens, "elapsed_s": round(self.elapsed, 3),
                "cpu_s": round(self.cpu, 3), "tokens_per_s": round(self.tokens / self.elapsed, 1),
                "tokens_per_cpu_s": round(self.tokens / max(self.cpu, 1e-6), 1),
                "peak_running": s["peak_running"], "peak_blocks": s["peak_blocks"], "num_blocks": s["num_blocks"],
                "steps": s["steps"], "preemptions": s["preemptions"], "kv_bytes": self.kv_bytes,
                "prefix_hit_rate": round(s["cached_tokens"] / max(1, s["prompt_tokens"]), 4),
                "computed_tokens": s["computed_tokens"]}


def run_interleaved(args: argparse.Namespace, modes: list[str], trace: list[tuple[list[int], int]],
                    progress: bool) -> dict[str, dict]:
    """Every mode on the trace, one step of each in turn: a neighbour's load on a shared machine
    then slows every mode alike instead of whichever happened to run at the time."""
    runs = [ModeRun(args, mode, trace) for mode in modes]
    total = len(modes) * sum(out for _, out in trace)
    with tqdm(total=total, desc=f"{'+'.join(modes)} tokens", unit="tok", disable=not progress,
              file=sys.stderr, mininterval=1.0) as bar:
        while any(r.engine.has_work() for r in runs):
            for r in runs:
                if r.engine.has_work():
                    bar.update(r.step())
    return {r.mode: r.result() for r in runs}


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "static" not in modes or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes {text!r}: give distinct modes from {','.join(MODES)}, static included "
                         "(it is the baseline of the ratios)")
    return modes


def measure(args: argparse.Namespace, log=print, progress: bool = False) -> dict:
    """Runs every mode of ``args.modes`` on one trace: {"modes": {mode: result}, "ratios": ...}.

    The modes run interleaved (``run_interleaved``); with ``args.repeats`` > 1 that happens
    round after round and each mode keeps its fastest run.
    """
    modes = parse_modes(args.modes)
    if not 1 <= args.min_output <= args.max_output or args.repeats < 1:
        raise SystemExit(f"need 1 <= --min-output <= --max-output (got {args.min_output}, {args.max_output}) "
                         f"and --repeats >= 1 (got {args.repeats})")
    trace = workload(args, PRESETS[args.model].vocab_size)
    threads = torch.get_num_threads()  # restored after: a caller's process keeps its setting
    torch.set_num_threads(args.threads or threads)
    results: dict[str, dict] = {}
    try:
        for _ in range(args.repeats):
            for mode, r in run_interleaved(args, modes, trace, progress).items():
                log(f"  {mode:<13} {r['elapsed_s']:6.1f} s ({r['cpu_s']:.1f} s CPU)")
                if mode not in results or r["elapsed_s"] < results[mode]["elapsed_s"]:
                    results[mode] = r
    finally:
        torch.set_num_threads(threads)
    base = results["static"]["tokens_per_s"]
    return {"modes": results, "ratios": {m: round(r["tokens_per_s"] / base, 2) for m, r in results.items()}}


def print_results(args: argparse.Namespace, res: dict) -> None:
    print(f"model {args.model}, {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt}"
          + (f" ({args.shared_fraction:.0%} start with one of {args.shared_prefixes} shared "
             f"{args.shared_prefix_len}-token prefixes)" if args.shared_fraction else "")
          + f", outputs {args.min_output}-{args.max_output}, max_model_len {args.max_model_len}, "
          f"KV budget {res['modes']['static']['kv_bytes'] / 2**20:.1f} MiB ({args.kv_blocks} blocks)")
    width = max(7, *(len(m) for m in res["modes"]))
    for r in res["modes"].values():
        hits = f", {r['prefix_hit_rate']:.0%} prefix hits" if r["mode"] == "paged+prefix" else ""
        print(f"{r['mode']:>{width}}: {r['tokens_per_s']:>9.1f} tokens/s  ({r['tokens']} tokens in "
              f"{r['elapsed_s']:.2f}s, peak {r['peak_running']} running, peak {r['peak_blocks']} blocks, "
              f"{r['steps']} steps, {r['preemptions']} preemptions{hits})")
    for mode, ratio in res["ratios"].items():
        if mode != "static":
            print(f"  ratio: {ratio:.2f}x tokens/s ({mode} / static)")
    busy = [m for m, r in res["modes"].items() if args.threads == 1 and r["elapsed_s"] > 1.25 * r["cpu_s"]]
    if busy:  # one thread: wall time well past CPU time means the process waited for a core
        print(f"  note: {', '.join(busy)} waited for a busy CPU (wall > 1.25x CPU time); rerun, or raise --repeats")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="static,paged", help=f"comma-separated, from {','.join(MODES)}")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--shared-fraction", type=float, default=0.0,
                    help="share of prompts that start with a shared prefix")
    ap.add_argument("--shared-prefixes", type=int, default=TraceConfig.num_shared_prefixes,
                    help="number of distinct shared prefixes")
    ap.add_argument("--shared-prefix-len", type=int, default=TraceConfig.shared_prefix_len)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=4 * 64 + 1,
                    help="KV budget in blocks: the default holds 4 static max_model_len requests")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the modes; each keeps its fastest run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    res = measure(args, log=(lambda *a: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True)),
                  progress=not args.json)
    if args.json:
        out = {**res["modes"], "ratios": res["ratios"]}
        if "paged" in res["ratios"]:
            out["ratio"] = res["ratios"]["paged"]  # paged / static, as before --modes existed
        print(json.dumps(out, indent=2))
        return
    print_results(args, res)


if __name__ == "__main__":
    main()
