#!/usr/bin/env python3
"""In-process block-pool benchmark on the reference trace (shared/trace.py).

Prints requests/s including SHA-256 hashing (hash + lookup + allocate + cache + free), the
allocate+free cost per block without hashing or prefix caching, the prefix hit rate (cached
tokens / prompt tokens) and blocks per request. The replay itself is kvpool.manager.core.bench,
which `kvpool bench` runs too.

    python scripts/bench_pool.py                 # the reference trace (100k requests)
    python scripts/bench_pool.py --requests 20000 --json
"""

from __future__ import annotations

import argparse
import json

from kvpool.manager.core.bench import report_lines, run_trace
from kvpool.shared.trace import TraceConfig


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
    if args.json:
        print(json.dumps({"with_hashing": full, "allocate_free_only": bare}, indent=2))
    else:
        print("\n".join(report_lines(cfg, full, bare)))


if __name__ == "__main__":
    main()
