#!/usr/bin/env python3
"""In-process block-pool benchmark on the reference trace (shared/trace.py).

Prints requests/s including SHA-256 hashing (hash + lookup + allocate + cache + free), the
allocate+free cost per block without hashing, the prefix hit rate (cached tokens / prompt
tokens) and blocks per request. Only the pool and hashing calls are timed, not trace generation.

    python scripts/bench_pool.py                 # the reference trace (100k requests)
    python scripts/bench_pool.py --requests 20000 --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

from kvpool.manager.pool import Pool
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.trace import TraceConfig, prompts


def run_trace(cfg: TraceConfig, *, hashing: bool, caching: bool = True) -> dict:
    pool = Pool(cfg.num_blocks, cfg.block_size, enable_caching=caching)
    bs = cfg.block_size
    alive: deque[int] = deque()
    timed = 0.0
    prompt_tokens = cached_tokens = blocks_total = 0
    clock = time.perf_counter
    for rid, tokens in enumerate(prompts(cfg)):
        n = len(tokens)
        if not hashing:
            hashes: list[bytes] = []
        t0 = clock()
        if hashing:
            hashes = hash_blocks(tokens, bs)
        if len(alive) >= cfg.max_alive:
            pool.free(alive.popleft())
        while (res := pool.allocate(rid, hashes, n, n)) is None:
            pool.free(alive.popleft())
        timed += clock() - t0
        alive.append(rid)
        prompt_tokens += n
        cached_tokens += res[0]
        blocks_total += len(res[1])
    t0 = clock()
    while alive:
        pool.free(alive.popleft())
    timed += clock() - t0
    return {
        "requests": cfg.num_requests,
        "seconds": timed,
        "requests_per_s": cfg.num_requests / timed,
        "us_per_block": timed / blocks_total * 1e6,
        "prefix_hit_rate": cached_tokens / prompt_tokens,
        "blocks_per_request": blocks_total / cfg.num_requests,
        "evictions": pool.blocks.num_evictions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=TraceConfig.num_requests)
    ap.add_argument("--blocks", type=int, default=TraceConfig.num_blocks)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    cfg = TraceConfig(num_requests=args.requests, num_blocks=args.blocks, seed=args.seed)
    full = run_trace(cfg, hashing=True)
    bare = run_trace(cfg, hashing=False, caching=False)
    out = {"with_hashing": full, "allocate_free_only": bare}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"reference trace: {cfg.num_requests} requests, block_size {cfg.block_size}, {cfg.num_blocks} blocks")
    print(f"  with SHA-256 hashing : {full['requests_per_s']:>10,.0f} requests/s "
          f"({full['seconds'] / cfg.num_requests * 1e6:.1f} us/request)")
    print(f"  allocate+free only   : {bare['us_per_block']:>10.3f} us/block "
          f"({bare['requests_per_s']:,.0f} requests/s)")
    print(f"  prefix hit rate      : {full['prefix_hit_rate']:>10.3%}")
    print(f"  blocks per request   : {full['blocks_per_request']:>10.2f}")
    print(f"  evictions            : {full['evictions']:>10,}")
    vllm_rps, vllm_us = 3750.0, 2.6  # vLLM v1 KVCacheManager on this trace (issue 2's figures)
    print(f"  vs vLLM v1 in-process: {full['requests_per_s'] / vllm_rps:.1f}x requests/s, "
          f"{vllm_us / bare['us_per_block']:.1f}x per block (quoted figures, not measured here)")


if __name__ == "__main__":
    main()
