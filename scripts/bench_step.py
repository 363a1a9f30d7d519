#!/usr/bin/env python3
"""The control-plane cost of one scheduler step, in process and through the manager daemon.

Part 1, the step message alone (no model; scripts/step_messages.py says exactly what each figure
is): R requests decode at block size 16 under the real scheduler. For R = 64, 256, 1024 it prints
the sub-ops per decode step (sparse, and dense: every request every step) and the time of one
step's sub-ops: ``run_step`` on an in-process pool, ``Server.handle_payload`` on the request's
bytes (the daemon's code without sockets; also timed after a 1 ms sleep, as a loop waking from
``poll`` runs it), the same bytes to a bare pyzmq server that answers at once (the transport's
floor), and round trips to real ``kvpool manager`` processes over ipc (p50/p99): the default
one, one with ``--busy-poll-us 0`` and one per ``--against`` checkout. Modes take turns in blocks of 16 steps, so each daemon gets its client's messages back
to back as from a worker; sparse steps are measured again with a pause after each reply
(``--gap-us``, default 1000, slept), standing in for a forward pass.

Part 2, the worker end to end (tiny preset, CPU, fp32): R running requests decode; tokens/s with
the in-process manager (the baseline), and through the daemon with overlap on (the reply read by
the client's receiver thread during the forward pass, the default, and without that thread) and
off, as ratios against the baseline measured in the same run; plus the manager wait a step is
exposed to (time blocked on the answer) against the round trip measured without overlap.

Targets: daemon + overlap >= 0.97x in-process tokens/s; exposed wait <= 10% of the
round trip; a 256-running decode step's daemon round trip <= 300 us p50 on a quiet machine.

    python scripts/bench_step.py            # R = 64, 256, 1024; worker at 256 running
    python scripts/bench_step.py --quick    # R = 64, 256; shorter runs
    python scripts/bench_step.py --json
    python scripts/bench_step.py --no-worker --against /path/to/base/checkout   # same-run A/B
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time

import torch
from bench_zmq_floor import serve as floor_serve
from manager_daemon import start_daemon
from step_messages import BS, FLOOR, message_part, print_messages

from kvpool.client.manager import ManagerClient
from kvpool.worker.block_manager import LocalBlockManager, RemoteBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.startup import build_engine

# -- part 2: the worker end to end -----------------------------------------------------------

MODES = ("in-process", "daemon, overlap", "daemon, overlap, no thread", "daemon, no overlap")


def build_worker(mode: str, endpoint: str, running: int, max_steps: int, seed: int):
    tiny = PRESETS["tiny"]
    blocks = running * (64 + max_steps + 32) // BS + 64
    bb = kv_spec(tiny, BS, torch.float32).block_bytes
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", block_size=BS, max_model_len=1024,
                       max_num_seqs=running, max_num_batched_tokens=4096, kv_cache_memory=blocks * bb,
                       overlap=mode != "daemon, no overlap", pool=f"w{MODES.index(mode)}", seed=seed)
    bm = (LocalBlockManager("bench") if mode == "in-process" else
          RemoteBlockManager(endpoint, cfg.pool, timeout_s=30, receiver_thread=mode == "daemon, overlap"))
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
    exposed_main = modes["daemon, overlap, no thread"]["manager_wait_us_per_step"]
    return {"running": running, "steps": rounds * block, "modes": modes,
            "ratios": {m: round(r["tokens_per_s"] / base, 3) for m, r in modes.items()},
            "exposed_wait_over_round_trip": round(exposed / round_trip, 3) if round_trip else None,
            "exposed_wait_no_thread_over_round_trip": round(exposed_main / round_trip, 3) if round_trip else None}


def print_report(res: dict) -> None:
    print_messages(res["messages"], res["message_steps"], res["message_block"], res["message_load"])
    for kind, poll in res["busy_poll"].items():
        print(f"  {kind}: busy-poll window {poll.get('window_us')} us, {poll.get('hits')} messages caught "
              f"spinning, {poll.get('misses')} empty windows, {poll.get('backoffs')} back-offs for CPU contention")
    if "worker" not in res:
        return
    w = res["worker"]
    print(f"worker, tiny preset on CPU, {w['running']} running, {w['steps']} decode steps per mode "
          f"(blocks of 10 in turn, medians; machine load {res['load_average']:.1f}):")
    for mode, m in w["modes"].items():
        print(f"  {mode:<26} {m['tokens_per_s']:>9} tokens/s  {m['ms_per_step']:>7} ms/step  "
              f"manager wait {m['manager_wait_us_per_step']:>7} us/step  {w['ratios'][mode]:.3f}x in-process")
    print(f"  exposed manager wait with overlap / round trip without: {w['exposed_wait_over_round_trip']} "
          f"(target <= 0.10; {w['exposed_wait_no_thread_over_round_trip']} when the reply is read after the "
          "forward pass, without the receiver thread)")


def start_daemons(tmp: str, against: list[str]) -> tuple[dict[str, str], list]:
    """The bare ping-pong server, the default daemon, one with busy polling off, and one per
    ``--against`` checkout."""
    flags = {"daemon": ([], None), "daemon, no busy-poll": (["--busy-poll-us", "0"], None)}
    for path in against:
        flags[f"daemon of {path}"] = ([], path)
    endpoints, procs = {FLOOR: f"ipc://{tmp}/floor.sock"}, []
    try:
        floor = mp.get_context("spawn").Process(target=floor_serve, args=(endpoints[FLOOR], False), daemon=True)
        floor.start()
        procs.append(floor)
        for i, (kind, (extra, checkout)) in enumerate(flags.items()):
            endpoints[kind] = f"ipc://{tmp}/manager{i}.sock"
            procs.append(start_daemon(endpoints[kind], 120, extra, quiet=True, checkout=checkout))
    except BaseException:
        stop_daemons(procs)
        raise
    return endpoints, procs


def stop_daemons(procs: list) -> None:
    for proc in procs:
        proc.terminate()
        if isinstance(proc, mp.process.BaseProcess):
            proc.join(10)
        else:
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="R = 64, 256 and shorter runs")
    ap.add_argument("--running", type=int, default=256, help="running requests in the worker part (<= 256)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the worker part")
    ap.add_argument("--rounds", type=int, default=0, help="worker rounds of 10 steps per mode [quick 4, else 12]")
    ap.add_argument("--steps", type=int, default=0, help="counted message steps per mode and row [quick 64, else 128]")
    ap.add_argument("--block", type=int, default=16, help="message steps per mode per turn (the first not counted)")
    ap.add_argument("--gap-us", type=int, default=1000,
                    help="client pause after each reply in the gap rows, a forward pass's stand-in (0: no gap rows)")
    ap.add_argument("--gap-spin", action="store_true", help="spin through the gap instead of sleeping")
    ap.add_argument("--against", action="append", default=[], metavar="CHECKOUT",
                    help="also step a daemon run from this checkout's code (e.g. /work/main), same turns")
    ap.add_argument("--no-worker", action="store_true", help="the message part only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.block < 2:
        ap.error("--block must be at least 2 (the first step of each block is not counted)")
    sizes, message_steps, rounds = ([64, 256], 64, 4) if args.quick else ([64, 256, 1024], 128, 12)
    rounds, message_steps = args.rounds or rounds, args.steps or message_steps
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-step-") as tmp:
        endpoints, daemons = start_daemons(tmp, args.against)
        try:
            res = {"message_steps": message_steps, "message_block": args.block,
                   "messages": message_part(sizes, message_steps, endpoints, args.seed, block=args.block,
                                            gap_us=args.gap_us, gap_spin=args.gap_spin),
                   "message_load": os.getloadavg()[0], "busy_poll": {}}
            for kind, endpoint in endpoints.items():
                if kind == FLOOR:
                    continue
                with ManagerClient(endpoint, timeout_s=30) as c:
                    res["busy_poll"][kind] = c.stats()["manager"].get("busy_poll") or {}
            if not args.no_worker:
                res["worker"] = worker_part(args.running, rounds, 10, endpoints["daemon"], args.seed, args.threads)
            res["load_average"] = os.getloadavg()[0]
        finally:
            stop_daemons(daemons)
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)


if __name__ == "__main__":
    main()
