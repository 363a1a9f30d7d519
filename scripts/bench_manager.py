#!/usr/bin/env python3
"""The reference trace (shared/trace.py) through the manager daemon, next to the in-process pool.

A real daemon (`kvpool manager`) on ipc:// serves one pool; ``--clients`` worker processes each
take every n-th request of the trace and drive it in scheduler steps: one ``step`` message per
step, freeing the requests admitted by the previous step and admitting the next ``--batch``
ones (``2 * batch`` sub-ops, 64 by default). Two comparisons, each measured in this run:

1. hashing in the loop: clients SHA-256 their prompts as a worker would, against
   kvpool.manager.core.bench.run_trace (hash + allocate + free in one process), the figure bench_pool prints;
2. hashes precomputed before the clock starts: the daemon against the very same steps run
   through ``run_step`` in one process, which isolates the cost of the daemon itself.

Prints requests/s, the ratio to in-process, and the step round trip p50/p99 the clients saw.

With ``--durability none,sync,async`` (and ``--redis-url``) a third comparison runs the
prehashed steps against daemons persisting their state in Redis (a fresh namespace each,
deleted afterwards), each against the no-persistence daemon of the same run.

    python scripts/bench_manager.py                    # the reference trace (100k requests)
    python scripts/bench_manager.py --requests 20000 --json
    python scripts/bench_manager.py --durability none,sync,async --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
from manager_daemon import start_daemon
from rtt_breakdown import StepTimes, attribute, join, tail_line

from kvpool.client.manager import ManagerClient
from kvpool.manager.core.bench import run_trace
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.protocol import KVSpec
from kvpool.shared.trace import TraceConfig, prompts

POOL = "bench"
SPEC = {"block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}


# -- the step loop (shared by the client processes and the in-process baseline) --------------


def load_share(shard_file: str) -> list[np.ndarray]:
    data = np.load(shard_file)
    tokens, offsets = data["tokens"], data["offsets"]
    return [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def alloc_ops(share: list[np.ndarray]) -> Iterator[dict]:
    """The share's alloc sub-ops, hashing each prompt when it is pulled."""
    bs = SPEC["block_size"]
    for i, arr in enumerate(share):
        toks = arr.tolist()
        yield {"op": "alloc", "req": i, "hashes": hash_blocks(toks, bs), "prompt_len": len(toks), "max_new": len(toks)}


def drive(allocs: Iterator[dict], batch: int, do_step: Callable[[list[dict]], list[dict]]) -> dict:
    """Steps: free the previous step's requests, admit up to ``batch`` new ones; retries no_space."""
    alive: list[int] = []
    waiting: list[dict] = []
    cached = prompt_tokens = 0
    more = True
    while more or alive or waiting:
        ops: list[dict] = [{"op": "free", "req": r} for r in alive]
        new = waiting
        while more and len(new) < batch:
            op = next(allocs, None)
            more = op is not None
            if more:
                new.append(op)
        results = do_step(ops + new)
        alive, waiting = [], []
        for op, res in zip(new, results[len(ops):]):
            if res["ok"]:
                alive.append(op["req"])
                cached += res["cached"]
                prompt_tokens += op["prompt_len"]
            elif res["code"] == "no_space":
                waiting.append(op)
            else:
                raise RuntimeError(f"alloc failed: {res}")
    return {"cached_tokens": cached, "prompt_tokens": prompt_tokens}


def client_main(endpoint: str, shard_file: str, out_file: str, epoch: int, batch: int, prehash: bool) -> None:
    share = load_share(shard_file)
    allocs = iter(list(alloc_ops(share))) if prehash else alloc_ops(share)
    # The client's own garbage collector would walk the prehashed ops (millions of objects) in
    # the middle of steps and show up as the daemon's tail: this measures the daemon.
    gc.collect()
    gc.freeze()
    # several clients step on one pool registered by the parent: only admin sessions may (manager/guards.py)
    client = ManagerClient(endpoint, identity=f"bench-client-{os.getpid()}", role="admin", timeout_s=60.0)
    client.hello()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's "go"
    timed = StepTimes(lambda ops: client.begin_step(POOL, epoch, ops), client.end_step)
    t_start, wait0 = time.perf_counter(), run_delay(os.getpid())
    res = drive(allocs, batch, timed.step)
    t_end = time.perf_counter()
    res["cpu_wait_s"] = run_delay(os.getpid()) - wait0
    timed.close()
    session = client.session
    client.deregister()
    client.close()
    np.savez(out_file, **timed.columns())
    print(json.dumps({"start": t_start, "end": t_end, "requests": len(share), "session": session,
                      "gc_s": timed.gc_s, **res}), flush=True)


def in_process_steps(shard_files: list[str], batch: int) -> dict:
    """The daemon run's exact steps, hashes precomputed, through run_step in this process."""
    pool = Pool(TraceConfig.num_blocks, SPEC["block_size"])
    shares = [list(alloc_ops(load_share(f))) for f in shard_files]
    t0 = time.perf_counter()
    for k, ops in enumerate(shares):
        drive(iter(ops), batch, lambda sub_ops, k=k: run_step(pool, k, sub_ops))
    seconds = time.perf_counter() - t0
    n = sum(len(s) for s in shares)
    return {"requests": n, "seconds": seconds, "requests_per_s": n / seconds}


# -- the parent ----------------------------------------------------------------------------


def write_shards(cfg: TraceConfig, clients: int, tmp: str) -> list[str]:
    parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for i, toks in enumerate(prompts(cfg)):
        parts[i % clients].append(np.asarray(toks, dtype=np.uint32))
    files = []
    for k, part in enumerate(parts):
        offsets = np.zeros(len(part) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in part], out=offsets[1:])
        tokens = np.concatenate(part) if part else np.zeros(0, np.uint32)
        files.append(os.path.join(tmp, f"shard{k}.npz"))
        np.savez(files[-1], tokens=tokens, offsets=offsets)
    return files


def run_daemon(endpoint: str, shard_files: list[str], batch: int, prehash: bool, tmp: str,
               extra: list[str] | None = None) -> dict:
    daemon = start_daemon(endpoint, 60, extra)
    procs: list[subprocess.Popen] = []
    try:
        admin = ManagerClient(endpoint, role="admin", timeout_s=30.0)
        reg = admin.register(POOL, shard_rank=0, shard_count=1, incarnation="bench", spec=SPEC,
                             available_kv_bytes=TraceConfig.num_blocks * KVSpec.from_wire(SPEC).block_bytes)
        for k, shard in enumerate(shard_files):
            cmd = [sys.executable, __file__, "--client", endpoint, shard, os.path.join(tmp, f"steps{k}.npz"),
                   str(reg["epoch"]), str(batch), str(int(prehash))]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout.readline().strip() == "ready", "a client failed to start"
        sched0, others0 = run_delay(daemon.pid), other_threads_delay(daemon.pid)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [json.loads(p.stdout.readline()) for p in procs]
        waited, others = run_delay(daemon.pid) - sched0, other_threads_delay(daemon.pid) - others0
        for p in procs:
            p.wait(60)
        all_stats = admin.call("stats", message_rows=True)
        server, store = all_stats["manager"], all_stats.get("store", {})
        admin.call("shutdown")
        admin.close()
        daemon.wait(30)
    finally:
        for p in [*procs, daemon]:
            if p.poll() is None:
                p.kill()
    steps = {o["session"]: dict(np.load(os.path.join(tmp, f"steps{k}.npz"))) for k, o in enumerate(outs)}
    rtts = np.concatenate([c["recv"] - c["begin"] for c in steps.values()])
    tail = attribute(join(steps, server.pop("message_rows")))
    step_msgs = server["message_recent"].get("step", {})
    n = sum(o["requests"] for o in outs)
    wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    return {
        "requests": n,
        "clients": len(outs),
        "seconds": wall,
        "requests_per_s": n / wall,
        "steps": len(rtts),
        "rtt_p50_us": float(np.percentile(rtts, 50) * 1e6),
        "rtt_p99_us": float(np.percentile(rtts, 99) * 1e6),
        "prefix_hit_rate": sum(o["cached_tokens"] for o in outs) / sum(o["prompt_tokens"] for o in outs),
        "daemon_iteration_p50_us": server["iteration_recent"]["p50"] * 1e6,
        "daemon_iteration_p99_us": server["iteration_recent"]["p99"] * 1e6,
        "daemon_iteration_cpu_p50_us": server["iteration_recent"]["cpu_p50"] * 1e6,
        "daemon_iteration_cpu_p99_us": server["iteration_recent"]["cpu_p99"] * 1e6,
        "daemon_iteration_messages_max": server["iteration_recent"]["messages_max"],
        "client_cpu_wait_s": sum(o["cpu_wait_s"] for o in outs),
        "daemon_cpu_wait_s": waited,
        "daemon_io_cpu_wait_s": others,
        "daemon_messages_per_iteration": server["messages"] / max(1, server["iteration_latency"]["count"]),
        "daemon_step_service_p50_us": step_msgs.get("service_p50", 0.0) * 1e6,
        "daemon_step_service_p99_us": step_msgs.get("service_p99", 0.0) * 1e6,
        "daemon_step_cpu_p50_us": step_msgs.get("cpu_p50", 0.0) * 1e6,
        "daemon_step_cpu_p99_us": step_msgs.get("cpu_p99", 0.0) * 1e6,
        "client_gc_s": sum(o["gc_s"] for o in outs),
        "daemon_gc": server["gc"],
        "tail": tail,
        "manager_errors": server["errors"],
        "manager_dropped": server["dropped"],
        "store": store,
    }


def run_delay(pid: int) -> float:
    """Seconds the process has waited for a CPU while runnable (Linux schedstat; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def other_threads_delay(pid: int) -> float:
    """run_delay of the process's threads but its main one (ZeroMQ's I/O thread, which moves
    every message in and out of the daemon)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return 0.0
    total = 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return total


def compare(inproc: dict, daemon: dict) -> dict:
    return {"in_process": inproc, "daemon": daemon,
            "throughput_ratio": daemon["requests_per_s"] / inproc["requests_per_s"],
            "p99_over_p50": daemon["rtt_p99_us"] / daemon["rtt_p50_us"]}


def report(title: str, r: dict) -> None:
    d = r["daemon"]
    print(f"  {title}")
    print(f"    in-process : {r['in_process']['requests_per_s']:>9,.0f} requests/s")
    print(f"    daemon     : {d['requests_per_s']:>9,.0f} requests/s = {r['throughput_ratio']:.2f}x in-process "
          f"(target >= 0.50), hit rate {d['prefix_hit_rate']:.2%}")
    print(f"    step round trip p50 {d['rtt_p50_us']:,.0f} us, p99 {d['rtt_p99_us']:,.0f} us: "
          f"p99/p50 {r['p99_over_p50']:.2f} (target <= 2.00); {d['steps']:,} steps, "
          f"manager errors {d['manager_errors'] or 'none'}")
    print(f"    where the tail is: the daemon's busy iterations take p50 {d['daemon_iteration_p50_us']:,.0f} us, "
          f"p99 {d['daemon_iteration_p99_us']:,.0f} us ({d['daemon_messages_per_iteration']:.1f} messages each, "
          f"up to {d['daemon_iteration_messages_max']}) of which its own CPU p50 "
          f"{d['daemon_iteration_cpu_p50_us']:,.0f} us, p99 {d['daemon_iteration_cpu_p99_us']:,.0f} us "
          f"(own-work p99/p50 {d['daemon_iteration_cpu_p99_us'] / d['daemon_iteration_cpu_p50_us']:.2f}); "
          f"waiting for a CPU while runnable: the daemon {d['daemon_cpu_wait_s'] / d['seconds']:.0%} of the run "
          f"(its ZeroMQ I/O thread {d['daemon_io_cpu_wait_s'] / d['seconds']:.0%}), "
          f"each client {d['client_cpu_wait_s'] / d['clients'] / d['seconds']:.0%} on average "
          f"(machine load {os.getloadavg()[0]:.1f})")
    t = d["tail"]
    print(f"    per step message in the daemon (its own rows, joined to the clients' steps: {t['steps']:,}): "
          f"handling p50 {d['daemon_step_service_p50_us']:,.0f} us, p99 {d['daemon_step_service_p99_us']:,.0f} us "
          f"(p99/p50 {d['daemon_step_service_p99_us'] / d['daemon_step_service_p50_us']:.2f}), its own CPU p50 "
          f"{d['daemon_step_cpu_p50_us']:,.0f} us, p99 {d['daemon_step_cpu_p99_us']:,.0f} us "
          f"(p99/p50 {d['daemon_step_cpu_p99_us'] / d['daemon_step_cpu_p50_us']:.2f}); queueing behind other "
          f"clients' messages p50 {t['queue_p50_us']:,.0f} us, p99 {t['queue_p99_us']:,.0f} us: "
          f"{t['queue_share']:.0%} of all round-trip time; GC: the clients {d['client_gc_s'] * 1e3:,.1f} ms in all, "
          f"the daemon {d['daemon_gc']['collections']} idle collections, longest {d['daemon_gc']['max_s'] * 1e3:,.2f} ms")
    print(f"    tail: {tail_line(t)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=TraceConfig.num_requests)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="requests admitted per step (sub-ops = 2x)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--durability", default="none",
                    help="comma-separated modes to compare: none (no persistence), sync, async")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = ap.parse_args()
    modes = [m.strip() for m in args.durability.split(",") if m.strip()]
    if not set(modes) <= {"none", "sync", "async"}:
        ap.error(f"--durability takes none, sync and async, got {args.durability!r}")
    cfg = TraceConfig(num_requests=args.requests, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        endpoint = f"ipc://{tmp}/manager.sock"
        shards = write_shards(cfg, args.clients, tmp)
        hashing = compare(run_trace(cfg, hashing=True), run_daemon(endpoint, shards, args.batch, False, tmp))
        prehashed = compare(in_process_steps(shards, args.batch), run_daemon(endpoint, shards, args.batch, True, tmp))
        durable = ({m: prehashed["daemon"] if m == "none" else run_durable(endpoint, shards, args.batch, tmp, m,
                                                                            args.redis_url) for m in modes}
                   if set(modes) - {"none"} else {})
    out = {"hashing": hashing, "prehashed": prehashed, "clients": args.clients, "sub_ops_per_step": 2 * args.batch}
    if durable:
        out["durability"] = durable
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"reference trace: {cfg.num_requests} requests, block_size {cfg.block_size}, {cfg.num_blocks} blocks; "
          f"daemon: {args.clients} client processes over ipc://, {2 * args.batch} sub-ops per step, "
          f"{os.cpu_count()} CPUs")
    report("SHA-256 hashing in the loop (in-process = kvpool.manager.core.bench.run_trace; clients hash their prompts)", hashing)
    report("hashes precomputed (in-process = the same steps through run_step, one process)", prehashed)
    if durable:
        report_durability(durable, prehashed["daemon"], args.redis_url)


def run_durable(endpoint: str, shards: list[str], batch: int, tmp: str, mode: str, redis_url: str) -> dict:
    """The prehashed run against a daemon that persists its state in Redis (a fresh namespace)."""
    import uuid

    import redis

    ns = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        return run_daemon(endpoint, shards, batch, True, tmp,
                          ["--redis-url", redis_url, "--namespace", ns, "--durability", mode])
    finally:
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(f"kvpool:{{{ns}}}:*"))
        if keys:
            r.delete(*keys)
        r.close()


def report_durability(runs: dict, none: dict, redis_url: str) -> None:
    print(f"  durability (hashes precomputed; Redis at {redis_url}; ratio = requests/s over no persistence)")
    for mode, d in runs.items():
        store = d.get("store") or {}
        extra = (f", {store.get('commits', 0):,} commits, {store.get('snapshots', 0)} snapshots, "
                 f"{store.get('failures', 0)} failures") if store.get("kind") == "redis" else ""
        print(f"    {mode:<5}: {d['requests_per_s']:>9,.0f} requests/s = {d['requests_per_s'] / none['requests_per_s']:.2f}x "
              f"(target >= 0.50 for sync), step p50 {d['rtt_p50_us']:,.0f} us, p99 {d['rtt_p99_us']:,.0f} us{extra}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        a = sys.argv[2:]
        client_main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5] == "1")
    else:
        main()
