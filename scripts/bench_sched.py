#!/usr/bin/env python3
"""The worker scheduler's own time per decode step at R running requests (no model, no daemon).

The real scheduler drives R decoding requests (scripts/step_messages.py's StepDriver: prompts
of 64-192 tokens, block size 16) against an in-process pool (``run_step``, not timed). Timed per step: ``schedule()`` plus ``update()``, the
work a worker does on the CPU before and after every forward pass. Two ways of knowing how many
distinct blocks the running requests hold take turns in blocks of steps in the same run:

  counted   worker/running_set.py keeps entries per block, changed where a table changes
  walked    a set built over every block table each step, in the usage statistic and in the
            admission room: the code before the count

With ``--against CHECKOUT`` a third mode takes its turns: that checkout's scheduler (its
``worker/`` loaded beside this one under another package name), counting as this build does: a
before/after of a scheduler change in one run.

Each mode has its own scheduler and pool with the same requests and seed, so all see the same
steps. The heap is frozen after set-up, as a worker's is once it is up
(worker/startup.freeze_start_up_heap), so a p99 is not a full collection over torch's modules.
Printed: median and p99 per step for each, and walked over counted.

    python scripts/bench_sched.py                 # R = 64, 256, 1024
    python scripts/bench_sched.py --sizes 256 --steps 400 --json
    python scripts/bench_sched.py --against /path/to/main-checkout
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import MethodType

from step_messages import BS, StepDriver, WorkerModules

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.worker.request import Request
from kvpool.worker.running_set import RunningSet
from kvpool.worker.scheduler import Scheduler
from kvpool.worker.scheduling_policy import admission_room
from kvpool.worker.startup import freeze_start_up_heap

MODES = ("counted", "walked")


def walked_held(running: list[Request]) -> int:
    return len({b for r in running for b in r.block_table})


def walk_every_table(sched: Scheduler) -> None:
    """The code before the count: the set over every table, each step and for each admission."""
    rs = sched.requests

    def track_usage(self: RunningSet) -> None:
        s = self.stats
        s.steps += 1
        s.peak_running = max(s.peak_running, sum(not r.step.admitting for r in self.running))
        s.peak_blocks = max(s.peak_blocks, walked_held(self.running))

    def room(self: Scheduler) -> int:
        return admission_room(self.running, self.num_blocks, self.block_size, self.static, walked_held(self.running))

    rs.track_usage = MethodType(track_usage, rs)
    rs._hold = rs._unhold = lambda blocks: None  # no counting beside the walk
    sched._room = MethodType(room, sched)


def load_checkout(path: str) -> WorkerModules:
    """The (Scheduler, Request, Output) of the checkout at ``path``: a copy of its ``worker/``
    imported as package ``kvpool_against`` (its own imports of kvpool.worker rewritten; the rest
    of kvpool, such as the pool core and the records, is this build's)."""
    src = Path(path) / "worker"
    if not (src / "scheduler.py").is_file():
        raise SystemExit(f"--against {path}: no worker/scheduler.py there (give a kvpool checkout)")
    dst = Path(tempfile.mkdtemp(prefix="bench-sched-")) / "kvpool_against"
    shutil.copytree(src, dst)
    for f in dst.glob("*.py"):
        f.write_text(re.sub(r"\bkvpool\.worker\b", "kvpool_against", f.read_text()))
    sys.path.insert(0, str(dst.parent))
    sched = importlib.import_module("kvpool_against.scheduler")
    return sched.Scheduler, importlib.import_module("kvpool_against.request").Request, sched.Output


def driver(num_reqs: int, steps: int, walk: bool, seed: int, worker: WorkerModules | None = None) -> StepDriver:
    """R decoding requests under the real scheduler (scripts/step_messages.py) on an in-process
    pool large enough for every request's growth over ``steps`` (no preemption)."""
    num_blocks = num_reqs * (192 + steps + 2 * BS) // BS + 64
    pool = Pool(num_blocks, BS)
    return StepDriver(num_reqs, False, lambda ops: run_step(pool, "bench", ops), seed, num_blocks=num_blocks,
                      setup=walk_every_table if walk else None, worker=worker)


def measure(num_reqs: int, steps: int, block: int, seed: int, against: WorkerModules | None = None) -> dict:
    drivers = {m: driver(num_reqs, steps, m == "walked", seed) for m in MODES}
    if against is not None:
        drivers["against"] = driver(num_reqs, steps, False, seed, against)
    freeze_start_up_heap()  # as a worker does once it is up (its imports, here the admitted requests too)
    done = 0
    while done < steps:
        for d in drivers.values():  # turns in blocks: each mode's steps back to back
            for _ in range(min(block, steps - done)):
                d.step()
        done += block
    out: dict = {"running": num_reqs, "steps": steps}
    for m, d in drivers.items():
        xs = sorted(d.sched_times)
        out[m] = {"p50_us": round(1e6 * statistics.median(xs), 1), "p99_us": round(1e6 * xs[int(0.99 * (len(xs) - 1))], 1)}
    blocks = {sum(len(r.block_table) for r in d.sched.running) for d in drivers.values()}
    if len(blocks) > 1 or len({d.sched.stats.peak_blocks for d in drivers.values()}) > 1:
        raise SystemExit("the modes diverged: they must schedule the same steps")
    out["block_table_entries"] = blocks.pop()
    out["walked_over_counted"] = round(out["walked"]["p50_us"] / out["counted"]["p50_us"], 2)
    if against is not None:
        out["against_over_counted"] = round(out["against"]["p50_us"] / out["counted"]["p50_us"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=20, help="steps per turn of each mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--against", metavar="CHECKOUT", help="also time that checkout's scheduler, in turns")
    args = ap.parse_args()
    against = load_checkout(args.against) if args.against else None
    rows = [measure(n, args.steps, args.block, args.seed, against) for n in args.sizes]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"scheduler time per decode step (schedule + update; the pool's run_step not counted), {args.steps} steps")
    print(f"{'running':>8} {'table entries':>14} {'counted p50':>12} {'p99':>8} {'walked p50':>11} {'p99':>8} {'walked/counted':>15}")
    for r in rows:
        c, w = r["counted"], r["walked"]
        print(f"{r['running']:>8} {r['block_table_entries']:>14,} {c['p50_us']:>10.0f}us {c['p99_us']:>6.0f}us "
              f"{w['p50_us']:>9.0f}us {w['p99_us']:>6.0f}us {r['walked_over_counted']:>14.2f}x")
    if against is not None:
        print(f"against {args.against}: its scheduler's p50 over this build's (counted), same steps in turns")
        for r in rows:
            a = r["against"]
            print(f"{r['running']:>8}  {a['p50_us']:>8.0f}us (p99 {a['p99_us']:.0f}us) vs {r['counted']['p50_us']:.0f}us: "
                  f"{r['against_over_counted']:.3f}x")


if __name__ == "__main__":
    main()
