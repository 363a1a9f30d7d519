#!/usr/bin/env python3
"""Bytecodes per request that the pool core executes on the reference trace, per function.

bench_pool.py's CPU times move by 10% and more with the load of the shared development
machine, so a change of a few percent to a hot path cannot be seen there; the number of
bytecodes does not depend on the load. It is not a time: a bytecode that indexes a list costs
far less than one that calls into C, and C work (SHA-256, dict probes, cache misses) is not
counted at all, so the CPU-time A/B of bench_pool.py still decides. It shows where the Python
work is and whether a change removed any.

The replay is bench.py's (free the oldest live request once 64 are alive, and again while an
allocation says no space; allocate the whole prompt). The first ``--warmup`` requests fill the
cache untraced, the next ``--requests`` are traced: opcode events of the core's own functions
(``manager/core/`` and ``shared/hashing.py``) are counted, hashing apart from allocate+free.
``--against REV`` counts git revision REV's core too (loaded as bench_pool.py does) and prints
both side by side with their difference.

    python scripts/count_pool_work.py
    python scripts/count_pool_work.py --against main
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import Counter, deque
from pathlib import Path

from bench_pool import load_revision

from kvpool.bench.trace import TraceConfig, prompts


def count(package: str, cfg: TraceConfig, warmup: int) -> tuple[Counter, int]:
    """Opcodes per (phase, file, function) over the requests of ``cfg`` after the first
    ``warmup``, and the number of blocks those requests were given."""
    pool_mod = importlib.import_module(package + ".manager.core.pool")
    hashing = importlib.import_module(package + ".shared.hashing")
    core_dirs = (str(Path(pool_mod.__file__).parent), hashing.__file__)
    counts: Counter = Counter()
    phase = ["hash"]

    def local(frame, event, arg):
        if event == "opcode":
            counts[(phase[0], Path(frame.f_code.co_filename).name, frame.f_code.co_name)] += 1
        return local

    def on_call(frame, event, arg):
        if not frame.f_code.co_filename.startswith(core_dirs):
            return None
        frame.f_trace_opcodes = True
        return local

    pool = pool_mod.Pool(cfg.num_blocks, cfg.block_size)
    alive: deque = deque()
    blocks = 0
    for i, tokens in enumerate(prompts(cfg)):
        traced = i >= warmup
        if traced:
            sys.settrace(on_call)
        phase[0] = "hash"
        hashes = hashing.hash_blocks(tokens, cfg.block_size)
        phase[0] = "pool"
        if len(alive) >= cfg.max_alive:
            pool.free(alive.popleft())
        n = len(tokens)
        while (res := pool.allocate(i, hashes, n, n)) is None:
            pool.free(alive.popleft())
        sys.settrace(None)
        alive.append(i)
        blocks += len(res[1]) if traced else 0
    return counts, blocks


def phase_lines(phase: str, runs: list[tuple[str, Counter, int]], n: int) -> list[str]:
    totals = [sum(v for k, v in c.items() if k[0] == phase) / n for _, c, _ in runs]
    head = f"{phase}: " + ", ".join(f"{t:,.1f} {name}" for (name, _, _), t in zip(runs, totals))
    if phase == "pool":
        head += " (per block: " + ", ".join(f"{t / (b / n):.1f}" for (_, _, b), t in zip(runs, totals)) + ")"
    if len(totals) == 2:
        head += f"; difference {totals[0] - totals[1]:+,.1f}"
    keys = {k[1:] for _, c, _ in runs for k in c if k[0] == phase}
    rows = sorted(keys, key=lambda k: -runs[0][1][(phase, *k)])
    out = [head]
    for key in rows:
        cells = "".join(f"{c[(phase, *key)] / n:10.1f}" for _, c, _ in runs)
        out.append(f"  {cells}  {key[0]}:{key[1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="traced requests")
    ap.add_argument("--warmup", type=int, default=2000, help="untraced requests first (the cache fills)")
    ap.add_argument("--against", metavar="REV", help="also count git revision REV's core")
    args = ap.parse_args()
    if args.requests < 1 or args.warmup < 0:
        ap.error("need --requests >= 1 and --warmup >= 0")
    cfg = TraceConfig(num_requests=args.warmup + args.requests)
    runs = [("this build", *count("kvpool", cfg, args.warmup))]
    if args.against:
        runs.append((args.against, *count(load_revision(args.against)[0], cfg, args.warmup)))
    if len({b for _, _, b in runs}) != 1:
        print(f"WARNING: the builds gave different numbers of blocks: {[b for _, _, b in runs]}")
    print(f"bytecodes per request over {args.requests} requests after {args.warmup} untraced "
          f"(columns: {', '.join(name for name, _, _ in runs)})")
    for phase in ("hash", "pool"):
        print("\n".join(phase_lines(phase, runs, args.requests)))


if __name__ == "__main__":
    main()
