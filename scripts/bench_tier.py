#!/usr/bin/env python3
"""The host tier against device only, on the real worker (CPU, fp32), in the same run.

Trace: P shared prefixes of L blocks each, their set about 3x the device tier and inside device
+ host; rounds of requests, each one prefix plus a short unique suffix, visited in a cycle (the
pattern LRU on the device alone cannot keep). Both configurations serve the same trace with the
in-process manager (the daemon's core and step executor); printed: prefix hit rate by tier,
prompt tokens computed, end-to-end tokens/s (prompt + output tokens over wall time), and whether
the greedy outputs are identical.

Each configuration runs --repeats times, interleaved; the best tokens/s of each is compared.

Targets: hit rate >= 2x device-only, tokens/s >= 1.3x, identical greedy output.

    python scripts/bench_tier.py            # small preset
    python scripts/bench_tier.py --quick    # tiny preset, fewer rounds
    python scripts/bench_tier.py --json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.request import SamplingParams
from kvpool.worker.startup import build_engine

BLOCK = 16


def trace(prefixes: int, prefix_blocks: int, rounds: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(2, vocab) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    return [p + [rng.randrange(2, vocab) for _ in range(7)] for _ in range(rounds) for p in shared]


def serve(model: str, prompts: list[list[int]], device_blocks: int, host_blocks: int, wave: int,
          max_tokens: int) -> dict:
    max_model_len = 1 << (max(len(p) for p in prompts) + max_tokens - 1).bit_length()
    block_bytes = kv_spec(PRESETS[model], BLOCK, torch.float32).block_bytes
    cfg = WorkerConfig(model=model, dtype="float32", device="cpu", block_size=BLOCK, max_model_len=max_model_len,
                       kv_cache_memory=device_blocks * block_bytes, host_kv_memory=host_blocks * block_bytes)
    engine = build_engine(cfg, LocalBlockManager("bench", max_blocks=device_blocks))
    params = SamplingParams(max_tokens=max_tokens)
    engine.generate([prompts[0][:BLOCK + 1]], params)  # warm-up: nothing of the trace cached
    pool = engine.bm.core
    base = (pool.stats.lookup_tokens, pool.stats.hit_tokens, engine.stats()["computed_tokens"])
    outs: list[list[list[int]]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), wave):
        outs += engine.generate(prompts[i:i + wave], params)
    wall = time.perf_counter() - t0
    lookup = pool.stats.lookup_tokens - base[0]
    hits = pool.stats.hit_tokens - base[1]
    host_hits = pool.host.stats.hit_tokens if pool.host is not None else 0
    tokens = sum(len(p) for p in prompts) + sum(len(o[0]) for o in outs)
    return {"device_blocks": device_blocks, "host_blocks": host_blocks, "hit_rate": hits / lookup,
            "device_hit_rate": (hits - host_hits) / lookup, "host_hit_rate": host_hits / lookup,
            "prompt_tokens_computed": engine.stats()["computed_tokens"] - base[2],
            "tokens_per_s": tokens / wall, "wall_s": wall, "outputs": outs,
            "saves": pool.host.stats.saves if pool.host else 0, "loads": pool.host.stats.loads if pool.host else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each configuration (best tokens/s)")
    args = ap.parse_args()
    model = "tiny" if args.quick else "small"
    prefixes, prefix_blocks, rounds = (9, 6, 2) if args.quick else (8, 12, 3)
    device_blocks = max(prefixes * prefix_blocks // 3, 2 * (prefix_blocks + 2))  # ~1/3 of the set, >= a wave
    host_blocks = prefixes * prefix_blocks + 16
    prompts = trace(prefixes, prefix_blocks, rounds, PRESETS[model].vocab_size)
    torch.manual_seed(0)
    runs: dict[str, list[dict]] = {"dev": [], "tier": []}
    for _ in range(args.repeats):  # interleaved, best tokens/s of each: a shared machine's noise
        runs["dev"].append(serve(model, prompts, device_blocks, 0, 2, 4))
        runs["tier"].append(serve(model, prompts, device_blocks, host_blocks, 2, 4))
    dev, tier = (max(runs[k], key=lambda r: r["tokens_per_s"]) for k in ("dev", "tier"))
    same = dev.pop("outputs") == tier.pop("outputs")
    ratio = {"hit_rate": tier["hit_rate"] / max(dev["hit_rate"], 1e-9),
             "tokens_per_s": tier["tokens_per_s"] / dev["tokens_per_s"], "identical_output": same}
    if args.json:
        print(json.dumps({"model": model, "device_only": dev, "device_host": tier, "ratio": ratio}, indent=2))
        return
    print(f"model {model}, {prefixes} prefixes x {prefix_blocks} blocks of {BLOCK} ({prefixes * prefix_blocks} "
          f"blocks, {prefixes * prefix_blocks / device_blocks:.1f}x the device tier of {device_blocks}), "
          f"{rounds} rounds, host tier {host_blocks} blocks")
    print(f"{'':14}{'hit rate':>9}{'device':>8}{'host':>8}{'computed':>10}{'tok/s':>9}{'saves':>7}{'loads':>7}")
    for name, r in (("device only", dev), ("device+host", tier)):
        print(f"{name:14}{r['hit_rate']:9.2f}{r['device_hit_rate']:8.2f}{r['host_hit_rate']:8.2f}"
              f"{r['prompt_tokens_computed']:10d}{r['tokens_per_s']:9.0f}{r['saves']:7d}{r['loads']:7d}")
    print(f"ratio: hit rate {ratio['hit_rate']:.2f}x (target >= 2), tokens/s {ratio['tokens_per_s']:.2f}x "
          f"(target >= 1.3), identical greedy output: {same}")


if __name__ == "__main__":
    main()
