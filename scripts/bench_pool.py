#!/usr/bin/env python3
"""In-process block-pool benchmark on the reference trace (bench/trace.py).

Prints, as the median of ``--rounds`` replays measured in this run: CPU µs per request including
SHA-256 hashing, split into hash, lookup+allocate and free; requests/s; the allocate+free cost
per block without hashing or prefix caching; the prefix hit rate (cached tokens / prompt
tokens) and blocks per request. CPU time (not wall time) is the figure that matters on a shared
machine: see kvpool.bench.pool, which `kvpool bench` runs too. No figure from elsewhere
is printed beside these. ``--against REV`` compares two builds in one run: it loads the pool
core and hashing of git revision REV (``shared/``, ``manager/core/`` and ``bench/``, extracted to a
temporary package) and alternates rounds of both on the same trace, printing CPU per request of each
phase for both and their ratios (REV / this build).

    python scripts/bench_pool.py                 # the reference trace (100k requests), 3 rounds
    python scripts/bench_pool.py --requests 20000 --rounds 5 --json
    python scripts/bench_pool.py --against main --rounds 5
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvpool.bench.pool import report_lines, run_trace
from kvpool.bench.trace import TraceConfig


def median_run(runs: list[dict]) -> dict:
    """Each numeric figure's median over the rounds (the trace is the same in each)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def baseline_run_trace(rev: str):
    """``run_trace`` of git revision ``rev`` (``load_revision``), so both builds run in this process.
    Revisions before the benchmark drivers left the product kept it in ``manager/core/bench.py``."""
    pkg, folders = load_revision(rev)
    return importlib.import_module(pkg + (".bench.pool" if "bench" in folders else ".manager.core.bench")).run_trace


def load_revision(rev: str) -> tuple[str, list[str]]:
    """Extracts git revision ``rev``'s ``shared/``, ``manager/core/`` and ``bench/`` (where it has
    one) as the package ``kvpool_base`` (imports rewritten); returns that package name, importable
    from now on, and the folders extracted."""
    root = Path(__file__).resolve().parent.parent
    tree = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", rev],
                          capture_output=True, text=True, check=False)  # an unknown rev: archive says so
    folders = ["shared", "manager/core", *(["bench"] if "bench" in tree.stdout.split() else [])]
    tar = subprocess.run(["git", "-C", str(root), "archive", rev, *folders],
                         capture_output=True, check=False)
    if tar.returncode:
        sys.exit(f"bench_pool: git archive {rev} failed: {tar.stderr.decode().strip()}")
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-bench-base-"))
    atexit.register(shutil.rmtree, tmp, True)
    pkg = tmp / "kvpool_base"
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
        tf.extractall(pkg, filter="data")
    for init in (pkg / "__init__.py", pkg / "manager" / "__init__.py"):
        init.touch()
    for py in pkg.rglob("*.py"):
        py.write_text(py.read_text().replace("kvpool.", "kvpool_base."))
    sys.path.insert(0, str(tmp))
    return "kvpool_base", folders


def compare_lines(rev: str, this: dict, base: dict) -> list[str]:
    phases = [("cpu_us_per_request", "total"), ("cpu_us_hash", "hash"),
              ("cpu_us_allocate", "lookup/allocate"), ("cpu_us_free", "free")]
    out = [f"against {rev} in the same run (CPU us/request, medians; ratio = {rev} / this build):"]
    for key, name in phases:
        out.append(f"  {name:<16}: {this[key]:7.1f} this build, {base[key]:7.1f} {rev}, {base[key] / this[key]:.2f}x")
    if (this["prefix_hit_rate"], this["blocks_per_request"]) != (base["prefix_hit_rate"], base["blocks_per_request"]):
        out.append(f"  WARNING: the builds disagree on the trace: hit rate {this['prefix_hit_rate']:.4%} against "
                   f"{base['prefix_hit_rate']:.4%}, blocks per request {this['blocks_per_request']:.3f} against "
                   f"{base['blocks_per_request']:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=TraceConfig.num_requests)
    ap.add_argument("--blocks", type=int, default=TraceConfig.num_blocks)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="replays of each kind; medians are printed")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--against", metavar="REV", help="also run git revision REV's core, alternating rounds")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    cfg = TraceConfig(num_requests=args.requests, num_blocks=args.blocks, seed=args.seed)
    base_run = baseline_run_trace(args.against) if args.against else None
    fulls, bares, bases = [], [], []
    for r in range(args.rounds):
        if base_run is not None and r % 2 == 0:  # alternate which build goes first
            bases.append(base_run(cfg, hashing=True))
        fulls.append(run_trace(cfg, hashing=True))
        if base_run is not None and r % 2 == 1:
            bases.append(base_run(cfg, hashing=True))
        bares.append(run_trace(cfg, hashing=False, caching=False))
    full, bare = median_run(fulls), median_run(bares)
    base = median_run(bases) if bases else None
    if args.json:
        out = {"with_hashing": full, "allocate_free_only": bare,
               "rounds": {"with_hashing": fulls, "allocate_free_only": bares}}
        if base is not None:
            out["against"] = {"rev": args.against, "with_hashing": base, "rounds": bases}
        print(json.dumps(out, indent=2))
        return
    print("\n".join(report_lines(cfg, full, bare)))
    totals = sorted(r["cpu_us_per_request"] for r in fulls)
    print(f"  rounds               : {args.rounds} (CPU us/request with hashing from {totals[0]:.1f} to {totals[-1]:.1f})")
    if base is not None:
        print("\n".join(compare_lines(args.against, full, base)))


if __name__ == "__main__":
    main()
