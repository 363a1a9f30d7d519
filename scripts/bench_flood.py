#!/usr/bin/env python3
"""A good client behind a flood: its step round trip while other clients pipeline thousands of steps.

A real daemon (`kvpool manager`) on ipc:// serves one pool per client. ``--floods`` processes
each send ``--messages`` step messages (an alloc and a free each: a mutation the commit must
persist) as fast as the socket takes them, reading the replies as they come. One good client
meanwhile sends one step at a time and records its round trips. Each configuration runs on a
fresh daemon in this run, against the same daemon with no time slice (``max_batch_ms = 0``:
an iteration takes up to ``max_batch`` messages, the loop before the slice was added):

    python scripts/bench_flood.py                           # no persistence, and Redis sync
    python scripts/bench_flood.py --floods 8 --messages 20000 --durability none
    python scripts/bench_flood.py --redis-url redis://127.0.0.1:6379/0 --json

Prints one table: per durability and slice, the good client's round trip p50/p99/max, the
flood's messages/s, and the p99 ratio of the sliced loop to the unsliced one of the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid

import numpy as np
import zmq
from manager_daemon import start_daemon

from kvpool.client.manager import ManagerClient
from kvpool.shared.protocol import encode_request, unpack
from kvpool.shared.step_ops import Alloc, Free, encode_ops

SPEC = {"block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
KV_BYTES = 2 * 1 * 1 * 8 * 2 * 16 * 4096  # 4096 blocks


def register(endpoint: str, pool: str) -> tuple[ManagerClient, int]:
    client = ManagerClient(endpoint, identity=f"{pool}-{os.getpid()}", timeout_s=30.0)
    body = client.register(pool, shard_rank=0, shard_count=1, incarnation=uuid.uuid4().hex, spec=SPEC,
                           available_kv_bytes=KV_BYTES)
    return client, body["epoch"]


def step_ops(req: int) -> list[dict]:
    hashes = [req.to_bytes(8, "little") * 4]  # one full block, its own hash: nothing shared
    return encode_ops([Alloc(req, hashes, 16, 1), Free(req)])


def flood_main(endpoint: str, pool: str, messages: int, go: mp.Event, out: mp.Queue) -> None:
    client, epoch = register(endpoint, pool)
    sid = client.sid
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    go.wait()
    sent = got = 0
    start = time.perf_counter()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
    while got < messages:
        events = dict(poller.poll(1000))
        if events.get(sock, 0) & zmq.POLLIN:
            while True:
                try:
                    unpack(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                got += 1
        if sent < messages and events.get(sock, 0) & zmq.POLLOUT:
            while sent < messages:
                payload = encode_request(sent + 1, "step", sid, {"pool": pool, "epoch": epoch, "ops": step_ops(sent)})
                try:
                    sock.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    break
                sent += 1
    out.put(("flood", messages / (time.perf_counter() - start)))
    sock.close()
    client.close()


def good_main(endpoint: str, go: mp.Event, stop: mp.Event, out: mp.Queue) -> None:
    client, epoch = register(endpoint, "good")
    go.wait()
    rtts, req = [], 0
    while not stop.is_set():
        t = time.perf_counter()
        client.end_step(client.begin_step("good", epoch, step_ops(req)))
        rtts.append(time.perf_counter() - t)
        req += 1
        time.sleep(0.002)  # a worker's step cadence, not a flood of its own
    out.put(("good", rtts))
    client.close()


def run_case(floods: int, messages: int, slice_ms: float, redis_url: str | None, tmp: str) -> dict:
    endpoint = f"ipc://{tmp}/m-{uuid.uuid4().hex[:8]}.sock"
    extra = []
    env_key = "KVPOOL_MANAGER_MAX_BATCH_MS"
    os.environ[env_key] = str(slice_ms)
    if redis_url:
        extra = ["--redis-url", redis_url, "--namespace", f"bench-flood-{uuid.uuid4().hex[:8]}"]
    daemon = start_daemon(endpoint, 60, extra, quiet=True)
    del os.environ[env_key]
    try:
        ctx = mp.get_context("spawn")
        go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=flood_main, args=(endpoint, f"flood-{i}", messages, go, out)) for i in range(floods)]
        good = ctx.Process(target=good_main, args=(endpoint, go, stop, out))
        for p in [*procs, good]:
            p.start()
        time.sleep(2.0 + 0.3 * floods)  # every client registered
        go.set()
        rates = []
        while len(rates) < floods:
            kind, value = out.get(timeout=600)
            rates.append(value)
        stop.set()
        kind, rtts = out.get(timeout=60)
        for p in [*procs, good]:
            p.join(timeout=30)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    ms = np.array(rtts) * 1000
    return {"slice_ms": slice_ms, "durability": "sync" if redis_url else "none", "samples": len(ms),
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max()), "flood_msgs_per_s": float(sum(rates))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floods", type=int, default=8)
    ap.add_argument("--messages", type=int, default=20000, help="step messages per flooding client")
    ap.add_argument("--slice-ms", type=float, default=5.0, help="the sliced loop's max_batch_ms")
    ap.add_argument("--durability", default="none,sync", help="none and/or sync (Redis)")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpool-flood-") as tmp:
        for mode in args.durability.split(","):
            url = args.redis_url if mode == "sync" else None
            base = run_case(args.floods, args.messages, 0.0, url, tmp)
            sliced = run_case(args.floods, args.messages, args.slice_ms, url, tmp)
            sliced["p99_ratio"] = sliced["p99_ms"] / base["p99_ms"]
            rows += [base, sliced]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.floods} clients flooding {args.messages} steps each, one good client stepping every 2 ms")
    print(f"{'durability':<10} {'slice':>8} {'good p50':>9} {'p99':>9} {'max':>9} {'flood msg/s':>12} {'p99 vs off':>11}")
    for r in rows:
        ratio = f"{r['p99_ratio']:.2f}x" if "p99_ratio" in r else "-"
        sl = f"{r['slice_ms']:g} ms" if r["slice_ms"] else "off"
        print(f"{r['durability']:<10} {sl:>8} {r['p50_ms']:>7.2f}ms {r['p99_ms']:>7.2f}ms {r['max_ms']:>7.1f}ms "
              f"{r['flood_msgs_per_s']:>12.0f} {ratio:>11}")


if __name__ == "__main__":
    sys.exit(main())
