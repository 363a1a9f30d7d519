"""Part 1 of scripts/bench_step.py: the step message alone (no model), at R running requests.

What a figure here is, and why it is measured so:

- **Modes take turns in blocks** of ``block`` steps (default 16). A real worker sends one step
  message per forward pass to one manager; interleaving every mode step by step (as this part
  once did) left each daemon idle through five other drivers' work between its messages, so its
  busy-poll window never caught one and every message paid two process wakeups and cold caches:
  a round trip no worker sees. The first step of each block (the daemon just woke up after the
  other modes' blocks) is a warm-up and is not counted; the rest are back to back.
- **Back to back** (the client's own scheduler work between messages, nothing else) is the
  least a step can cost. **With a gap** (``gap_us`` slept or spun on the client after each reply,
  standing in for a GPU forward pass of a small model, 1-3 ms) is what a worker without overlap
  waits: the daemon has gone idle by then unless its busy-poll window is longer than the gap.
- **Modes.** ``in-process``: ``run_step`` on a Pool (what the worker's local manager does).
  ``handle_payload``: the daemon's code without sockets: the request packed, ``Server.handle_payload``
  on its bytes, the reply unpacked (the daemon's CPU per message plus the client's codec).
  ``handle_payload, after a sleep``: the same, each step timed after ``COLD_SLEEP_S`` asleep, as a
  daemon's loop is when it wakes from ``poll`` for a message: what the same code costs once the
  core's caches went cold or the core slept (a daemon's handling is measured against this, not
  against the hot loop above). ``bare ping-pong``: the same request bytes to a bare pyzmq
  ROUTER over ipc that sleeps in ``poll`` and answers 456 bytes at once (scripts/bench_zmq_floor.py),
  no kvpool code on its side: the transport and the two process wake-ups a daemon round trip
  cannot go below on this machine. Then one mode per daemon process over ipc
  (``ManagerClient.step``): the default one, one with busy polling off, and any started from
  another checkout (``--against``) for a same-run A/B.

A sub-op count is per decode step: sparse (a request appears when it needs a block or became
full) and dense (every running request every step, as before sparse steps, same scheduler).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import zmq

from kvpool.client.manager import ManagerClient
from kvpool.manager.config import ManagerConfig
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.manager.server import Server
from kvpool.shared.protocol import KVSpec, encode_request, raise_for_reply, unpack
from kvpool.shared.step_ops import Result, SubOp, decode_results, encode_ops
from kvpool.worker.request import Request
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Output, Scheduler

BS = 16
SPEC = KVSpec(BS, 2, 2, 16, "float32")
IN_PROCESS, HANDLE_PAYLOAD, HANDLE_COLD = "in-process", "handle_payload", "handle_payload, after a sleep"
FLOOR = "bare ping-pong"  # the mode whose endpoint is a bench_zmq_floor server, not a daemon
WorkerModules = tuple[type, type, type]  # (Scheduler, Request, Output) of a build
COLD_SLEEP_S = 0.001


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class StepDriver:
    """The real scheduler over ``num_reqs`` decoding requests (no model: every sequence that
    reaches its end samples token 7), stepping against ``do_step``."""

    def __init__(self, num_reqs: int, dense: bool, do_step: Callable[[list[SubOp]], list[Result]], seed: int,
                 pause_s: float = 0.0, num_blocks: int = 8192,
                 setup: Callable[[Scheduler], None] | None = None, worker: WorkerModules | None = None):
        rng = random.Random(seed)
        # another build's scheduler (scripts/bench_sched.py --against): its own classes, same driver
        sched_cls, request_cls, self.output_cls = worker or (Scheduler, Request, Output)
        self.sched, self.dense, self.do_step = sched_cls(BS, num_blocks, num_reqs, 4096), dense, do_step
        if setup is not None:
            setup(self.sched)  # before any request is added (scripts/bench_sched.py's baseline)
        self.pause_s = pause_s  # slept before each timed step's sub-ops (not timed)
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
        for i in range(num_reqs):
            n = rng.randint(64, 192)
            self.sched.add(request_cls(i, f"c{i}", 0, [rng.randrange(2, 30000) for _ in range(n)], n, params, i, BS))
        self.times: list[float] = []
        self.sched_times: list[float] = []  # the thread's CPU in schedule() + update() of each timed step
        self.sub_ops = 0
        while self.sched.waiting or any(r.num_remaining > 1 for r in self.sched.running):
            self.step(timed=False)  # admissions and prefill

    def step(self, timed: bool = True) -> None:
        sched = self.sched
        if self.dense:
            for r in sched.running:
                r.kv.mark_shared()  # as before sparse steps: every running request, every step
        c0 = time.thread_time()
        plan = sched.schedule()
        c1 = time.thread_time()
        if self.pause_s and timed:
            time.sleep(self.pause_s)
        t0 = time.perf_counter()
        results = self.do_step(plan.ops) if plan.ops else []
        if timed:  # a stepper may say how much of its call was not what is measured
            self.times.append(time.perf_counter() - t0 - getattr(self.do_step, "untimed_s", 0.0))
            self.sub_ops += len(plan.ops)
        c2 = time.thread_time()
        batch = plan.batch(results)
        sched.update(plan, results, [self.output_cls(r, 7) for r, s in zip(batch.reqs, batch.seqs) if s.sample])
        if timed:
            self.sched_times.append(c1 - c0 + time.thread_time() - c2)

    def summary(self) -> dict:
        return {"sub_ops_per_step": round(self.sub_ops / len(self.times), 2),
                "p50_us": round(1e6 * statistics.median(self.times), 1),
                "p99_us": round(1e6 * percentile(self.times, 0.99), 1)}


class PayloadServer:
    """``Server.handle_payload`` on real bytes, no socket: a session and one pool per size."""

    def __init__(self) -> None:
        self.server = Server(ManagerConfig(endpoint="ipc:///nonexistent/kvpool-bench.sock"))
        self.next_id = 1
        self.sid = self.call("hello", None, {"identity": "bench", "versions": [1]})["sid"]

    def call(self, op: str, sid: str | None, args: dict) -> dict:
        self.next_id += 1
        raw = encode_request(self.next_id, op, sid, args)
        return raise_for_reply(unpack(self.server.handle_payload(raw, time.monotonic())))

    def register(self, name: str, blocks: int) -> int:
        return self.call("register", self.sid, {"pool": name, "shard_rank": 0, "shard_count": 1, "incarnation": "bench",
                                                "spec": SPEC.to_wire(),
                                                "available_kv_bytes": blocks * SPEC.block_bytes})["epoch"]

    def stepper(self, name: str, epoch: int) -> Callable[[list[SubOp]], list[Result]]:
        return lambda ops: decode_results(ops, self.call("step", self.sid, {"pool": name, "epoch": epoch,
                                                                           "ops": encode_ops(ops)})["results"])


class FloorStepper:
    """Sends the step's request bytes to a bare pyzmq echo server and waits for its reply (the
    timed part); the results come from an in-process pool, whose time is ``untimed_s``."""

    def __init__(self, endpoint: str, ctx: zmq.Context, blocks: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pool, self.next_id, self.untimed_s = Pool(blocks, BS), 1, 0.0

    def __call__(self, ops: list[SubOp]) -> list[Result]:
        self.next_id += 1
        self.sock.send(encode_request(self.next_id, "step", "0" * 32, {"pool": "p", "epoch": 1,
                                                                       "ops": encode_ops(ops)}))
        if not self.sock.poll(30_000):
            raise RuntimeError("the bare ping-pong server did not answer within 30 s")
        self.sock.recv()
        t0 = time.perf_counter()
        results = run_step(self.pool, "b", ops)
        self.untimed_s = time.perf_counter() - t0
        return results

    def close(self) -> None:
        self.sock.close()


def _gap(gap_s: float, spin: bool) -> None:
    if spin:
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(gap_s)


def run_turns(drivers: dict[str, StepDriver], steps: int, block: int, gap_s: float, spin: bool) -> None:
    """Each driver steps ``block`` times in turn until each made ``steps`` counted steps; the
    first step of each block is not counted (the daemon was idle during the other blocks)."""
    for _ in range(-(-steps // (block - 1))):
        for d in drivers.values():
            for i in range(block):
                d.step(timed=i > 0)
                if gap_s:
                    _gap(gap_s, spin)


def _drivers(num_reqs: int, dense: bool, endpoints: dict[str, str], payload: PayloadServer, blocks: int,
             seed: int, clients: list, tag: str) -> dict[str, StepDriver]:
    pool = Pool(blocks, BS)
    drivers = {IN_PROCESS: StepDriver(num_reqs, dense, lambda ops: run_step(pool, "b", ops), seed)}
    name = f"bench-{num_reqs}-{tag}"
    drivers[HANDLE_PAYLOAD] = StepDriver(num_reqs, dense, payload.stepper(name, payload.register(name, blocks)), seed)
    cold = f"{name}-cold"
    drivers[HANDLE_COLD] = StepDriver(num_reqs, dense, payload.stepper(cold, payload.register(cold, blocks)), seed,
                                      pause_s=COLD_SLEEP_S)
    for kind, endpoint in endpoints.items():
        if kind == FLOOR:
            floor = FloorStepper(endpoint, zmq.Context.instance(), blocks)
            clients.append(floor)
            drivers[kind] = StepDriver(num_reqs, dense, floor, seed)
            continue
        c = ManagerClient(endpoint, timeout_s=30)
        clients.append(c)
        epoch = c.register(name, shard_rank=0, shard_count=1, incarnation="bench", spec=SPEC.to_wire(),
                           available_kv_bytes=blocks * SPEC.block_bytes)["epoch"]
        drivers[kind] = StepDriver(num_reqs, dense,
                                   lambda ops, c=c, n=name, e=epoch: decode_results(ops, c.step(n, e, encode_ops(ops))),
                                   seed)
    return drivers


def message_part(sizes: list[int], steps: int, endpoints: dict[str, str], seed: int, *, block: int = 16,
                 gap_us: int = 1000, gap_spin: bool = False) -> list[dict]:
    """Rows per size: sparse and dense back to back, then sparse with ``gap_us`` between steps
    (0: not measured). Every mode of a row is driven in the same turns, so a neighbour's load
    falls on all of them alike."""
    rows = []
    payload = PayloadServer()
    cases = [(False, 0.0, "back to back"), (True, 0.0, "back to back")]
    if gap_us:
        cases.append((False, gap_us / 1e6, f"{gap_us} us gap ({'spun' if gap_spin else 'slept'})"))
    for num_reqs in sizes:
        blocks = num_reqs * (192 + 2 * steps + 64) // BS + 64
        for j, (dense, gap_s, pacing) in enumerate(cases):
            clients: list = []
            drivers = _drivers(num_reqs, dense, endpoints, payload, blocks, seed, clients, str(j))
            try:
                run_turns(drivers, steps, block, gap_s, gap_spin)
            finally:
                for c in clients:
                    if isinstance(c, ManagerClient):
                        c.deregister()
                    c.close()
            rows.append({"running": num_reqs, "message": "dense" if dense else "sparse", "pacing": pacing,
                         "modes": {kind: d.summary() for kind, d in drivers.items()}})
    return rows


def print_messages(rows: list[dict], steps: int, block: int, load: float) -> None:
    print(f"step messages at block size {BS}: ~{steps} counted decode steps per mode, modes in turn in blocks of "
          f"{block} (the first step of each block not counted); times in us; machine load {load:.1f}")
    for r in rows:
        first = next(iter(r["modes"].values()))
        print(f"  {r['running']:>5} running, {r['message']}, {r['pacing']}: {first['sub_ops_per_step']} sub-ops/step")
        base = r["modes"][IN_PROCESS]["p50_us"]
        for kind, m in r["modes"].items():
            print(f"    {kind:<34} p50 {m['p50_us']:>9}  p99 {m['p99_us']:>9}  {m['p50_us'] / base:6.2f}x in-process p50")
