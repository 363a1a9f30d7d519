"""The reference trace replayed against an in-process pool (``kvpool bench``, bench_pool.py).

Only the hashing and pool calls are timed, not trace generation. Per request: SHA-256 of its
full blocks (when ``hashing``), free the oldest live request once 64 are alive (and again while
an allocation says no space), allocate the whole prompt, which looks up and caches its blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvpool.manager.core.pool import Pool
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.trace import TraceConfig, prompts

# vLLM v1's in-process KVCacheManager on this trace, as reported by vLLM's authors (not measured here)
VLLM_REQUESTS_PER_S, VLLM_US_PER_BLOCK = 3750.0, 2.6


def run_trace(cfg: TraceConfig, *, hashing: bool, caching: bool = True,
              progress: Callable[[int], None] | None = None) -> dict:
    pool = Pool(cfg.num_blocks, cfg.block_size, enable_caching=caching)
    bs = cfg.block_size
    alive: deque[int] = deque()
    timed = 0.0
    prompt_tokens = cached_tokens = blocks_total = 0
    clock = time.perf_counter
    hashes: list[bytes] = []
    for rid, tokens in enumerate(prompts(cfg)):
        n = len(tokens)
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
        if progress is not None and rid % 1000 == 999:
            progress(1000)
    t0 = clock()
    while alive:
        pool.free(alive.popleft())
    timed += clock() - t0
    pool.check_invariants()
    return {
        "requests": cfg.num_requests,
        "seconds": timed,
        "requests_per_s": cfg.num_requests / timed,
        "us_per_block": timed / blocks_total * 1e6,
        "prefix_hit_rate": cached_tokens / prompt_tokens,
        "blocks_per_request": blocks_total / cfg.num_requests,
        "evictions": pool.blocks.num_evictions,
    }


def report_lines(cfg: TraceConfig, full: dict, bare: dict) -> list[str]:
    return [
        f"reference trace: {cfg.num_requests} requests, block_size {cfg.block_size}, {cfg.num_blocks} blocks",
        f"  with SHA-256 hashing : {full['requests_per_s']:>10,.0f} requests/s "
        f"({full['seconds'] / cfg.num_requests * 1e6:.1f} us/request)",
        f"  allocate+free only   : {bare['us_per_block']:>10.3f} us/block ({bare['requests_per_s']:,.0f} requests/s)",
        f"  prefix hit rate      : {full['prefix_hit_rate']:>10.3%}",
        f"  blocks per request   : {full['blocks_per_request']:>10.2f}",
        f"  evictions            : {full['evictions']:>10,}",
        f"  vs vLLM v1 in-process: {full['requests_per_s'] / VLLM_REQUESTS_PER_S:.1f}x requests/s, "
        f"{VLLM_US_PER_BLOCK / bare['us_per_block']:.1f}x per block (vLLM's reported figures, not measured here)",
    ]
