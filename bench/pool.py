"""The reference trace replayed against an in-process pool (``kvpool bench``, bench_pool.py).

Only the hashing and pool calls are timed, not trace generation. Per request: SHA-256 of its
full blocks (when ``hashing``), free the oldest live request once 64 are alive (and again while
an allocation says no space), allocate the whole prompt, which looks up and caches its blocks.

Requests go in chunks of ``CHUNK``: the chunk's prompts are hashed (CPU time measured around
that), then replayed against the pool (CPU time measured around the replay, and wall time around
each allocate and each free). CPU time is what the targets are about: on a shared machine, wall
time also counts the time other processes hold the core. The pool's CPU time is split between
lookup+allocate and free by their shares of the wall time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from kvpool.bench.trace import TraceConfig, prompts
from kvpool.manager.core.pool import Pool
from kvpool.shared.hashing import hash_blocks

CHUNK = 1000


@dataclass
class _Tally:
    cpu_hash: float = 0.0
    cpu_pool: float = 0.0
    wall_hash: float = 0.0
    wall_allocate: float = 0.0
    wall_free: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    blocks: int = 0
    alive: deque = field(default_factory=deque)


def _hash_chunk(chunk: list[list[int]], block_size: int, tally: _Tally) -> list[list[bytes]]:
    c0, w0 = time.process_time(), time.perf_counter()
    hashes = [hash_blocks(tokens, block_size) for tokens in chunk]
    tally.cpu_hash += time.process_time() - c0
    tally.wall_hash += time.perf_counter() - w0
    return hashes


def _free_oldest(pool: Pool, alive: deque) -> float:
    t0 = time.perf_counter()
    pool.free(alive.popleft())
    return time.perf_counter() - t0


def _replay_chunk(pool: Pool, first_rid: int, chunk: list[list[int]], hashes: list[list[bytes]] | None,
                  max_alive: int, tally: _Tally) -> None:
    clock, alive = time.perf_counter, tally.alive
    c0 = time.process_time()
    for i, tokens in enumerate(chunk):
        n = len(tokens)
        if len(alive) >= max_alive:
            tally.wall_free += _free_oldest(pool, alive)
        t0 = clock()
        res = pool.allocate(first_rid + i, hashes[i] if hashes else (), n, n)
        tally.wall_allocate += clock() - t0
        while res is None:
            tally.wall_free += _free_oldest(pool, alive)
            t0 = clock()
            res = pool.allocate(first_rid + i, hashes[i] if hashes else (), n, n)
            tally.wall_allocate += clock() - t0
        alive.append(first_rid + i)
        tally.prompt_tokens += n
        tally.cached_tokens += res[0]
        tally.blocks += len(res[1])
    tally.cpu_pool += time.process_time() - c0


def run_trace(cfg: TraceConfig, *, hashing: bool, caching: bool = True,
              progress: Callable[[int], None] | None = None) -> dict:
    pool = Pool(cfg.num_blocks, cfg.block_size, enable_caching=caching)
    tally = _Tally()
    trace, rid = prompts(cfg), 0
    while chunk := list(islice(trace, CHUNK)):
        hashes = _hash_chunk(chunk, cfg.block_size, tally) if hashing else None
        _replay_chunk(pool, rid, chunk, hashes, cfg.max_alive, tally)
        rid += len(chunk)
        if progress is not None:
            progress(len(chunk))
    c0 = time.process_time()
    while tally.alive:
        tally.wall_free += _free_oldest(pool, tally.alive)
    tally.cpu_pool += time.process_time() - c0
    pool.check_invariants()
    return _summary(cfg, pool, tally)


def _summary(cfg: TraceConfig, pool: Pool, t: _Tally) -> dict:
    n = max(cfg.num_requests, 1)
    wall = t.wall_hash + t.wall_allocate + t.wall_free
    pool_wall = max(t.wall_allocate + t.wall_free, 1e-12)
    cpu_allocate = t.cpu_pool * t.wall_allocate / pool_wall
    cpu = t.cpu_hash + t.cpu_pool
    return {
        "requests": cfg.num_requests,
        "seconds": wall,
        "requests_per_s": cfg.num_requests / max(wall, 1e-12),
        "cpu_seconds": cpu,
        "cpu_us_per_request": cpu / n * 1e6,
        "cpu_us_hash": t.cpu_hash / n * 1e6,
        "cpu_us_allocate": cpu_allocate / n * 1e6,
        "cpu_us_free": (t.cpu_pool - cpu_allocate) / n * 1e6,
        "us_per_block": t.cpu_pool / max(t.blocks, 1) * 1e6,
        "prefix_hit_rate": t.cached_tokens / max(t.prompt_tokens, 1),
        "blocks_per_request": t.blocks / n,
        "evictions": pool.blocks.num_evictions,
    }


def report_lines(cfg: TraceConfig, full: dict, bare: dict) -> list[str]:
    return [
        f"reference trace: {cfg.num_requests} requests, block_size {cfg.block_size}, {cfg.num_blocks} blocks",
        f"  with SHA-256 hashing : {full['cpu_us_per_request']:>10.1f} us CPU/request "
        f"(hash {full['cpu_us_hash']:.1f} + lookup/allocate {full['cpu_us_allocate']:.1f} "
        f"+ free {full['cpu_us_free']:.1f}); {full['requests_per_s']:,.0f} requests/s wall",
        f"  allocate+free only   : {bare['us_per_block']:>10.3f} us CPU/block "
        f"({bare['cpu_us_per_request']:.1f} us CPU/request; no hashing, no prefix caching)",
        f"  prefix hit rate      : {full['prefix_hit_rate']:>10.3%}",
        f"  blocks per request   : {full['blocks_per_request']:>10.2f}",
        f"  evictions            : {full['evictions']:>10,.0f}",
    ]
