#!/usr/bin/env python3
"""The control-plane cost of one scheduler step, in process and through the manager daemon.

Part 1, the step message alone (no model): R requests decode at block size 16 under the real
scheduler. For R = 64, 256, 1024 it prints the sub-ops per decode step (sparse: a request appears
when it needs a block; dense: every request every step, as before sparse steps, driven by the same
scheduler) and the time of one step's sub-ops: ``run_step`` on an in-process pool, and a round
trip to a real ``kvpool manager`` process over ipc (p50/p99).

Part 2, the worker end to end (tiny preset, CPU, fp32): R running requests decode; tokens/s with
the in-process manager (the baseline), and through the daemon with overlap on and off, as ratios
against the baseline measured in the same run; plus the manager wait a step is exposed to (time
blocked on the answer) against the round trip measured without overlap.

Targets: daemon + overlap >= 0.97x in-process tokens/s; exposed wait <= 10% of the
round trip; a 256-running decode step's daemon round trip <= 300 us p50 on a quiet machine.

    python scripts/bench_step.py            # R = 64, 256, 1024; worker at 256 running
    python scripts/bench_step.py --quick    # R = 64, 256; shorter runs
    python scripts/bench_step.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from manager_daemon import start_daemon

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.protocol import KVSpec
from kvpool.worker.block_manager import LocalBlockManager, RemoteBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.manager_client import ManagerClient
from kvpool.worker.request import Request
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Output, Scheduler
from kvpool.worker.startup import build_engine

BS = 16
SPEC = KVSpec(BS, 2, 2, 16, "float32")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- part 1: the step message ----------------------------------------------------------------


class StepDriver:
    """The real scheduler over ``num_reqs`` decoding requests (no model: every sequence that
    reaches its end samples token 7), stepping against ``do_step``."""

    def __init__(self, num_reqs: int, dense: bool, do_step: Callable[[list[dict]], list[dict]], seed: int):
        rng = random.Random(seed)
        self.sched, self.dense, self.do_step = Scheduler(BS, 8192, num_reqs, 4096), dense, do_step
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
        for i in range(num_reqs):
            n = rng.randint(64, 192)
            self.sched.add(Request(i, f"c{i}", 0, [rng.randrange(2, 30000) for _ in range(n)], n, params, i, BS))
        self.times: list[float] = []
        self.sub_ops = 0
        while self.sched.waiting or any(r.num_remaining > 1 for r in self.sched.running):
            self.step(timed=False)  # admissions and prefill

    def step(self, timed: bool = True) -> None:
        sched = self.sched
        if self.dense:
            for r in sched.running:
                r.must_sync = True  # as before sparse steps: every running request, every step
        plan = sched.schedule()
        t0 = time.perf_counter()
        results = self.do_step(plan.ops) if plan.ops else []
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.sub_ops += len(plan.ops)
        batch = plan.batch(results)
        sched.update(plan, results, [Output(r, 7) for r, s in zip(batch.reqs, batch.seqs) if s.sample])

    def summary(self) -> dict:
        return {"sub_ops_per_step": round(self.sub_ops / len(self.times), 2),
                "p50_us": round(1e6 * statistics.median(self.times), 1),
                "p99_us": round(1e6 * percentile(self.times, 0.99), 1)}


def message_part(sizes: list[int], steps: int, endpoint: str, seed: int) -> list[dict]:
    """Per size, four drivers (sparse and dense, in process and through the daemon) step in
    turn, so a neighbour's load falls on all of them alike."""
    rows = []
    for num_reqs in sizes:
        blocks = num_reqs * (192 + steps + 64) // BS + 64
        clients, drivers = [], {}
        for dense in (False, True):
            pool = Pool(blocks, BS)
            drivers[(dense, "in_process")] = StepDriver(num_reqs, dense, lambda ops, p=pool: run_step(p, "b", ops), seed)
            c = ManagerClient(endpoint, timeout_s=30)
            clients.append(c)
            name = f"bench-{num_reqs}-{int(dense)}"
            epoch = c.register(name, shard_rank=0, shard_count=1, incarnation="bench", spec=SPEC.to_wire(),
                               available_kv_bytes=blocks * SPEC.block_bytes)["epoch"]
            drivers[(dense, "daemon")] = StepDriver(num_reqs, dense,
                                                    lambda ops, c=c, n=name, e=epoch: c.step(n, e, ops), seed)
        for _ in range(steps):
            for d in drivers.values():
                d.step()
        for c in clients:
            c.deregister()
            c.close()
        for dense in (False, True):
            rows.append({"running": num_reqs, "message": "dense" if dense else "sparse",
                         "in_process": drivers[(dense, "in_process")].summary(),
                         "daemon": drivers[(dense, "daemon")].summary()})
    return rows


# -- part 2: the worker end to end -----------------------------------------------------------

MODES = ("in-process", "daemon, overlap", "daemon, no overlap")


def build_worker(mode: str, endpoint: str, running: int, max_steps: int, seed: int):
    tiny = PRESETS["tiny"]
    blocks = running * (64 + max_steps + 32) // BS + 64
    bb = kv_spec(tiny, BS, torch.float32).block_bytes
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", block_size=BS, max_model_len=1024,
                       max_num_seqs=running, max_num_batched_tokens=4096, kv_cache_memory=blocks * bb,
                       overlap=mode != "daemon, no overlap", pool=f"w{MODES.index(mode)}", seed=seed)
    bm = LocalBlockManager("bench") if mode == "in-process" else RemoteBlockManager(endpoint, cfg.pool, timeout_s=30)
    engine = build_engine(cfg, bm)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for _ in range(running):
        engine.add_request([rng.randrange(2, tiny.vocab_size) for _ in range(rng.randint(32, 64))], params)
    while engine.scheduler.waiting or any(r.num_computed < r.num_prompt for r in engine.scheduler.running):
        engine.step()  # admissions and prefill
    for _ in range(3):
        engine.step()
    return engine, bm


def worker_part(running: int, rounds: int, block: int, endpoint: str, seed: int, threads: int) -> dict:
    """The three modes run blocks of ``block`` decode steps in turn for ``rounds`` rounds; each
    mode's figure is the median over its blocks (load on a shared machine hits blocks alike)."""
    torch.set_num_threads(threads)
    workers = {m: build_worker(m, endpoint, running, rounds * block, seed) for m in MODES}
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    waits: dict[str, list[float]] = {m: [] for m in MODES}
    tokens = dict.fromkeys(MODES, 0)
    for _ in range(rounds):
        for mode, (engine, _) in workers.items():
            wait0, t0 = engine.manager_wait_s, time.perf_counter()
            for _ in range(block):
                tokens[mode] += sum(ev.token is not None for ev in engine.step())
            per_step[mode].append((time.perf_counter() - t0) / block)
            waits[mode].append((engine.manager_wait_s - wait0) / block)
    for engine, bm in workers.values():
        engine.shutdown()
        bm.close()
    modes = {}
    for m in MODES:
        step_s = statistics.median(per_step[m])
        modes[m] = {"tokens_per_s": round(tokens[m] / (rounds * block) / step_s, 1), "ms_per_step": round(1e3 * step_s, 3),
                    "manager_wait_us_per_step": round(1e6 * statistics.median(waits[m]), 1)}
    base = modes["in-process"]["tokens_per_s"]
    round_trip = modes["daemon, no overlap"]["manager_wait_us_per_step"]
    exposed = modes["daemon, overlap"]["manager_wait_us_per_step"]
    return {"running": running, "steps": rounds * block, "modes": modes,
            "ratios": {m: round(r["tokens_per_s"] / base, 3) for m, r in modes.items()},
            "exposed_wait_over_round_trip": round(exposed / round_trip, 3) if round_trip else None}


def print_report(res: dict) -> None:
    print(f"step messages at block size {BS} ({res['message_steps']} decode steps each; "
          f"times in us; machine load: {os.getloadavg()[0]:.1f})")
    print(f"  {'running':>7} {'message':>7} {'sub-ops/step':>12} {'in-proc p50':>11} {'p99':>8} "
          f"{'daemon p50':>10} {'p99':>8}")
    for r in res["messages"]:
        i, d = r["in_process"], r["daemon"]
        print(f"  {r['running']:>7} {r['message']:>7} {i['sub_ops_per_step']:>12} {i['p50_us']:>11} "
              f"{i['p99_us']:>8} {d['p50_us']:>10} {d['p99_us']:>8}")
    w = res["worker"]
    print(f"worker, tiny preset on CPU, {w['running']} running, {w['steps']} decode steps per mode "
          "(blocks of 10 in turn, medians):")
    for mode, m in w["modes"].items():
        print(f"  {mode:<19} {m['tokens_per_s']:>9} tokens/s  {m['ms_per_step']:>7} ms/step  "
              f"manager wait {m['manager_wait_us_per_step']:>7} us/step  {w['ratios'][mode]:.3f}x in-process")
    print(f"  exposed manager wait with overlap / round trip without: {w['exposed_wait_over_round_trip']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="R = 64, 256 and shorter runs")
    ap.add_argument("--running", type=int, default=256, help="running requests in the worker part (<= 256)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the worker part")
    ap.add_argument("--rounds", type=int, default=0, help="worker rounds of 10 steps per mode [quick 4, else 12]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    sizes, message_steps, rounds = ([64, 256], 64, 4) if args.quick else ([64, 256, 1024], 256, 12)
    rounds = args.rounds or rounds
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-step-") as tmp:
        endpoint = f"ipc://{tmp}/manager.sock"
        daemon = start_daemon(endpoint, 120, quiet=True)
        try:
            res = {"message_steps": message_steps, "messages": message_part(sizes, message_steps, endpoint, args.seed),
                   "worker": worker_part(args.running, rounds, 10, endpoint, args.seed, args.threads),
                   "load_average": os.getloadavg()[0]}
        finally:
            daemon.terminate()
            daemon.wait(10)
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)


if __name__ == "__main__":
    main()
