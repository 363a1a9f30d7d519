#!/usr/bin/env python3
"""Same-process A/B of a step's daemon-side checks and sub-ops: another checkout against this one.

``check_owner``, ``check_step`` (manager/guards.py) and ``run_step`` (manager/core/step.py) of
CHECKOUT (loaded from its files under other module names; everything they import is this tree's)
and of this tree run on two identical pools with the same sub-ops: R running requests decode
under the real scheduler, sparse steps. The order of the two alternates every step, and the
results must be equal. Figures are the thread's CPU time per step (medians), so a neighbour's
load moves both alike and preemption is not counted.

    python scripts/bench_step_parts.py /path/to/base/checkout [--running 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

from step_messages import BS, SPEC, StepDriver

from kvpool.manager import guards as new_guards
from kvpool.manager.core import step as new_step
from kvpool.manager.core.pool import Pool
from kvpool.manager.registry import Registry
from kvpool.manager.state.entries import PoolEntry, Session, Shard
from kvpool.shared.step_ops import (
    Result,
    SubOp,
    decode_ops,
    decode_results,
    encode_ops,
    encode_results,
)

PARTS = ("check_owner", "check_step", "run_step")


def load(checkout: str, alias: str, rel: str):
    spec = importlib.util.spec_from_file_location(alias, os.path.join(checkout, rel))
    if spec is None or spec.loader is None:
        raise SystemExit(f"{checkout} has no {rel}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="the other source tree (e.g. a `git archive` of the base commit)")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    old = (load(args.checkout, "base_guards", "manager/guards.py"), load(args.checkout, "base_step", "manager/core/step.py"))
    blocks = args.running * (192 + args.steps + 64) // BS + 64
    entries = []
    for _ in range(2):
        entry = PoolEntry("p", 1)
        entry.pool = Pool(blocks, BS)
        entry.shards[0] = Shard(0, "bench", SPEC, 0, blocks, "sid")
        entries.append(entry)
    reg = Registry("bench", session_timeout_s=60)
    sess = reg.sessions["sid"] = Session("sid", 1, "bench", "worker", False, 1, 0.0, 0.0)
    bounds, clock = new_guards.Bounds(), time.thread_time
    sides = [("base", *old, entries[0]), ("new", new_guards, new_step, entries[1])]
    times: dict[tuple[str, str], list[float]] = {(side, part): [] for side, *_ in sides for part in PARTS}

    def do_step(ops: list[SubOp]) -> list[Result]:
        # Both sides get the wire maps. A checkout whose check_step takes records (this one)
        # decodes them inside its check_step part, as the daemon does; its results are
        # encoded (not timed) to be compared with the other side's.
        wire = encode_ops(ops)
        sides.reverse()
        results, records = {}, []
        for side, guards, step, entry in sides:
            typed = hasattr(step, "Refused")
            t0 = clock()
            guards.check_owner(reg, sess, entry)
            t1 = clock()
            sub_ops = decode_ops(wire) if typed else wire
            guards.check_step(bounds, entry, "sid", sub_ops)
            t2 = clock()
            res = step.run_step(entry.pool, "sid", sub_ops)
            t3 = clock()
            for part, t in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2)):
                times[side, part].append(t)
            if typed:
                records = res
            results[side] = encode_results(res) if typed else res
        if results["base"] != results["new"]:
            raise SystemExit("the two checkouts' run_step answered the same sub-ops differently")
        return records or decode_results(ops, results["new"])

    driver = StepDriver(args.running, False, do_step, 0)
    for ts in times.values():
        ts.clear()
    for _ in range(args.steps):
        driver.step()
    print(f"{args.running} running, sparse, {driver.sub_ops / len(driver.times):.1f} sub-ops/step, {args.steps} steps; "
          f"CPU us per step (medians); machine load {os.getloadavg()[0]:.1f}")
    for part in PARTS:
        base, new = (1e6 * statistics.median(times[side, part]) for side in ("base", "new"))
        print(f"  {part:<12} {args.checkout}: {base:7.1f}  this tree: {new:7.1f}  ratio {new / base:.2f}")


if __name__ == "__main__":
    main()
