#!/usr/bin/env python3
"""Paged KV memory against static max_model_len preallocation, at the same KV memory budget.

Both runs use the same model, weights, scheduler, manager (in-process) and paged-attention path;
the baseline only reserves ``max_model_len`` slots for every request at admission (and shares
nothing), as engines without paging do. On a mixed-length trace the paged worker holds more
requests at once, so its decode batches are larger. Every request is submitted at t=0; tokens/s
is generated tokens over the wall time of the whole trace. Prompts come from the reference trace
generator (shared/trace.py), output lengths from the same seed.

    python scripts/bench_worker.py                       # small preset, CPU
    python scripts/bench_worker.py --model tiny --requests 64 --json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from kvpool.shared.trace import TraceConfig, prompts
from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.profiler import page_bytes
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.startup import build_engine


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    cfg = TraceConfig(num_requests=args.requests, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                      vocab_size=vocab, shared_fraction=args.shared_fraction, seed=args.seed)
    rng = random.Random(args.seed)
    return [(p, rng.randint(args.min_output, args.max_output)) for p in prompts(cfg)]


def run(args: argparse.Namespace, static: bool, trace: list[tuple[list[int], int]]) -> dict:
    model = PRESETS[args.model]
    block_bytes = page_bytes(args.block_size, model.num_kv_heads, model.head_size, torch.float32) * model.num_layers
    cfg = WorkerConfig(model=args.model, dtype="float32", device=args.device, block_size=args.block_size,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=args.kv_blocks * block_bytes, static_prealloc=static, seed=args.seed)
    engine = build_engine(cfg, LocalBlockManager("bench"))
    engine.generate([trace[0][0]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    engine.scheduler.stats.__init__()
    for prompt, out_len in trace:
        engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    tokens = 0
    start = time.perf_counter()
    while engine.has_work():
        tokens += sum(ev.token is not None for ev in engine.step())
    elapsed = time.perf_counter() - start
    s = engine.stats()
    return {"mode": "static" if static else "paged", "tokens": tokens, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1), "peak_running": s["peak_running"],
            "peak_blocks": s["peak_blocks"], "num_blocks": s["num_blocks"], "steps": s["steps"],
            "preemptions": s["preemptions"], "kv_bytes": args.kv_blocks * block_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--shared-fraction", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=4 * 64 + 1,
                    help="KV budget in blocks: the default holds 4 static max_model_len requests")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = workload(args, PRESETS[args.model].vocab_size)
    static, paged = run(args, True, trace), run(args, False, trace)
    ratio = paged["tokens_per_s"] / static["tokens_per_s"]
    if args.json:
        print(json.dumps({"static": static, "paged": paged, "ratio": round(ratio, 2)}, indent=2))
        return
    print(f"model {args.model}, {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
          f"outputs {args.min_output}-{args.max_output}, max_model_len {args.max_model_len}, "
          f"KV budget {static['kv_bytes'] / 2**20:.1f} MiB ({args.kv_blocks} blocks)")
    for r in (static, paged):
        print(f"{r['mode']:>7}: {r['tokens_per_s']:>9.1f} tokens/s  ({r['tokens']} tokens in {r['elapsed_s']:.2f}s, "
              f"peak {r['peak_running']} running, peak {r['peak_blocks']} blocks, {r['steps']} steps, "
              f"{r['preemptions']} preemptions)")
    print(f"  ratio: {ratio:.2f}x tokens/s (paged / static)")


if __name__ == "__main__":
    main()
