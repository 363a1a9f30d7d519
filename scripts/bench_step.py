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

Targets (issue 16): daemon + overlap >= 0.97x in-process tokens/s; exposed wait <= 10% of the
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.protocol import block_bytes
from kvpool.worker.block_manager import LocalBlockManager, RemoteBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.manager_client import ManagerClient
from kvpool.worker.request import Request
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Output, Scheduler
from kvpool.worker.startup import build_engine

BS = 16
SPEC = {"block_size": BS, "num_layers": 2, "num_kv_heads": 2, "head_size": 16, "dtype": "float32"}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_daemon(endpoint: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from kvpool.cli.main import cli; cli()", "manager", "-m", endpoint,
           "--session-timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            with ManagerClient(endpoint, role="admin", timeout_s=1.0) as c:
                c.hello()
            return proc
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the manager daemon did not start: try `kvpool manager -m ipc://...`") from None
            time.sleep(0.2)


# -- part 1: the step message ----------------------------------------------------------------


def decode_steps(num_reqs: int, steps: int, dense: bool, do_step: Callable[[list[dict]], list[dict]],
                 seed: int) -> dict:
    """Admits ``num_reqs`` prompts, then times ``steps`` decode steps' ``do_step(ops)``."""
    rng = random.Random(seed)
    sched = Scheduler(BS, 8192, num_reqs, 4096)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for i in range(num_reqs):
        n = rng.randint(64, 192)
        sched.add(Request(i, f"c{i}", 0, [rng.randrange(2, 30000) for _ in range(n)], n, params, i, BS))

    def one(timed: list[float] | None) -> int:
        if dense:
            for r in sched.running:
                r.must_sync = True  # as before sparse steps: every running request, every step
        plan = sched.schedule()
        t0 = time.perf_counter()
        results = do_step(plan.ops) if plan.ops else []
        if timed is not None:
            timed.append(time.perf_counter() - t0)
        batch = plan.batch(results)
        sched.update(plan, results, [Output(r, 7) for r, s in zip(batch.reqs, batch.seqs) if s.sample])
        return len(plan.ops)

    while sched.waiting or any(r.num_remaining > 1 for r in sched.running):
        one(None)  # admissions and prefill
    times: list[float] = []
    ops = [one(times) for _ in range(steps)]
    return {"sub_ops_per_step": round(sum(ops) / steps, 2), "p50_us": round(1e6 * statistics.median(times), 1),
            "p99_us": round(1e6 * percentile(times, 0.99), 1), "steps": steps}


def message_part(sizes: list[int], steps: int, endpoint: str, seed: int) -> list[dict]:
    rows = []
    for num_reqs in sizes:
        blocks = num_reqs * (192 + steps + 64) // BS + 64
        for dense in (False, True):
            pool = Pool(blocks, BS)
            inproc = decode_steps(num_reqs, steps, dense, lambda ops, p=pool: run_step(p, "bench", ops), seed)
            with ManagerClient(endpoint, timeout_s=30) as c:
                name = f"bench-{num_reqs}-{int(dense)}"
                epoch = c.register(name, shard_rank=0, shard_count=1, incarnation="bench", spec=SPEC,
                                   available_kv_bytes=blocks * block_bytes(SPEC))["epoch"]
                daemon = decode_steps(num_reqs, steps, dense, lambda ops, c=c, n=name, e=epoch: c.step(n, e, ops),
                                      seed)
            rows.append({"running": num_reqs, "message": "dense" if dense else "sparse", "in_process": inproc,
                         "daemon": daemon})
    return rows


# -- part 2: the worker end to end -----------------------------------------------------------


def worker_run(mode: str, endpoint: str, running: int, steps: int, seed: int) -> dict:
    tiny = PRESETS["tiny"]
    blocks = running * (64 + steps + 32) // BS + 64
    bb = block_bytes(kv_spec(tiny, BS, torch.float32))
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", block_size=BS, max_model_len=512,
                       max_num_seqs=running, max_num_batched_tokens=4096, kv_cache_memory=blocks * bb,
                       overlap=mode != "daemon, no overlap", pool=f"w-{mode.replace(' ', '').replace(',', '-')}",
                       seed=seed)
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
    wait0, tokens, t0 = engine.manager_wait_s, 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(ev.token is not None for ev in engine.step())
    elapsed = time.perf_counter() - t0
    wait = engine.manager_wait_s - wait0
    engine.shutdown()
    bm.close()
    return {"mode": mode, "tokens_per_s": round(tokens / elapsed, 1), "ms_per_step": round(1e3 * elapsed / steps, 3),
            "manager_wait_us_per_step": round(1e6 * wait / steps, 1)}


def worker_part(running: int, steps: int, repeats: int, endpoint: str, seed: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    modes = ("in-process", "daemon, overlap", "daemon, no overlap")
    best: dict[str, dict] = {}
    for _ in range(repeats):  # modes in turn, best of each: a neighbour's load hits a round, not a mode
        for mode in modes:
            r = worker_run(mode, endpoint, running, steps, seed)
            if mode not in best or r["tokens_per_s"] > best[mode]["tokens_per_s"]:
                best[mode] = r
    base = best["in-process"]["tokens_per_s"]
    round_trip = best["daemon, no overlap"]["manager_wait_us_per_step"]
    exposed = best["daemon, overlap"]["manager_wait_us_per_step"]
    return {"running": running, "steps": steps, "modes": best,
            "ratios": {m: round(r["tokens_per_s"] / base, 3) for m, r in best.items()},
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
    print(f"worker, tiny preset on CPU, {w['running']} running, {w['steps']} decode steps:")
    for mode, m in w["modes"].items():
        print(f"  {mode:<19} {m['tokens_per_s']:>9} tokens/s  {m['ms_per_step']:>7} ms/step  "
              f"manager wait {m['manager_wait_us_per_step']:>7} us/step  {w['ratios'][mode]:.3f}x in-process")
    print(f"  exposed manager wait with overlap / round trip without: {w['exposed_wait_over_round_trip']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="R = 64, 256 and shorter runs")
    ap.add_argument("--running", type=int, default=256, help="running requests in the worker part (<= 256)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the worker part")
    ap.add_argument("--repeats", type=int, default=3, help="worker rounds; each mode keeps its best")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    sizes, message_steps, worker_steps = ([64, 256], 64, 30) if args.quick else ([64, 256, 1024], 256, 100)
    repeats = args.repeats
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-step-") as tmp:
        endpoint = f"ipc://{tmp}/manager.sock"
        daemon = start_daemon(endpoint)
        try:
            res = {"message_steps": message_steps, "messages": message_part(sizes, message_steps, endpoint, args.seed),
                   "worker": worker_part(args.running, worker_steps, repeats, endpoint, args.seed, args.threads),
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
