#!/usr/bin/env python3
"""In-process block-pool benchmark on the reference trace (shared/trace.py).

Prints, as the median of ``--rounds`` replays measured in this run: CPU µs per request including
SHA-256 hashing, split into hash, lookup+allocate and free; requests/s; the allocate+free cost
per block without hashing or prefix caching; the prefix hit rate (cached tokens / prompt
tokens) and blocks per request. CPU time (not wall time) is the figure that matters on a shared
machine: see kvpool.manager.core.bench, which `kvpool bench` runs too. No figure from elsewhere
is printed beside these: compare two builds by running this script on each.

    python scripts/bench_pool.py                 # the reference trace (100k requests), 3 rounds
    python scripts/bench_pool.py --requests 20000 --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvpool.manager.core.bench import report_lines, run_trace
from kvpool.shared.trace import TraceConfig


def median_run(runs: list[dict]) -> dict:
    """Each numeric figure's median over the rounds (the trace is the same in each)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=TraceConfig.num_requests)
    ap.add_argument("--blocks", type=int, default=TraceConfig.num_blocks)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="replays of each kind; medians are printed")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    cfg = TraceConfig(num_requests=args.requests, num_blocks=args.blocks, seed=args.seed)
    fulls, bares = [], []
    for _ in range(args.rounds):
        fulls.append(run_trace(cfg, hashing=True))
        bares.append(run_trace(cfg, hashing=False, caching=False))
    full, bare = median_run(fulls), median_run(bares)
    if args.json:
        print(json.dumps({"with_hashing": full, "allocate_free_only": bare,
                          "rounds": {"with_hashing": fulls, "allocate_free_only": bares}}, indent=2))
        return
    print("\n".join(report_lines(cfg, full, bare)))
    totals = sorted(r["cpu_us_per_request"] for r in fulls)
    print(f"  rounds               : {args.rounds} (CPU us/request with hashing from {totals[0]:.1f} to {totals[-1]:.1f})")


if __name__ == "__main__":
    main()
