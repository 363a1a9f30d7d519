#!/usr/bin/env python3
"""How long the manager's loop stops for a `check` admin op on a large state, old path vs new.

Builds one pool of ``--blocks`` blocks (1M by default: ~80% held by live requests, ~15% cached
and free) in a real manager loop (a thread of this process, a real ZeroMQ socket). Then, A/B
interleaved ``--rounds`` times, an admin client asks `check` while another client sends
heartbeats back to back; what is measured is the longest heartbeat round trip during the check
(the loop's stall as a client sees it) and the check's own round trip:

- old: the loop checks block by block itself (``Registry.check_invariants``; forced here by
  raising the inline limit);
- new: the loop forks a child that checks in bulk (manager/check_job.py); the loop pauses for
  the fork.

    python scripts/bench_check.py                 # 1M blocks
    python scripts/bench_check.py --blocks 200000 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import threading
import time

from kvpool.client.manager import ManagerClient
from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.protocol import KVSpec

SPEC = {"block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
REQ_BLOCKS = 64


def build(srv: Server, blocks: int, seed: int) -> int:
    """Fills the pool through the registry's own operations; returns the live requests."""
    reg, rng = srv.registry, random.Random(seed)
    sess = reg.open_session("bench", "worker", True, 1, time.monotonic())
    entry = reg.register(sess, "big", 0, 1, "i", KVSpec(**SPEC), blocks * KVSpec.from_wire(SPEC).block_bytes)
    n = REQ_BLOCKS * SPEC["block_size"]
    target = int(0.95 * blocks) // REQ_BLOCKS
    for msg, start in enumerate(range(0, target, 16)):
        ops = [{"op": "alloc", "req": r, "hashes": [rng.randbytes(32) for _ in range(REQ_BLOCKS - 1)],
                "prompt_len": n, "max_new": n} for r in range(start, min(start + 16, target))]
        reg.step(sess, entry, ops, msg)
    freed = range(int(0.15 * blocks) // REQ_BLOCKS)
    reg.step(sess, entry, [{"op": "free", "req": r} for r in freed], 1 << 30)
    reg.sessions[sess.sid].last_seen = float("inf")  # never expires during the run
    gc.collect()
    gc.freeze()
    return len(entry.pool.requests)


def one_check(endpoint: str, admin: ManagerClient) -> tuple[float, float]:
    """(check round trip, longest heartbeat round trip meanwhile), seconds."""
    stop, worst = threading.Event(), [0.0]

    def beat() -> None:
        c = ManagerClient(endpoint, identity="beat", timeout_s=60)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.heartbeat()
                worst[0] = max(worst[0], time.perf_counter() - t0)
        finally:
            c.close()

    t = threading.Thread(target=beat)
    t.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    admin.call("check")
    check_s = time.perf_counter() - t0
    time.sleep(0.1)
    stop.set()
    t.join()
    return check_s, worst[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/m.sock"
        srv = Server(ManagerConfig(endpoint=endpoint, max_blocks=args.blocks + 1, session_timeout_s=3600))
        requests = build(srv, args.blocks, args.seed)
        srv.bind()
        loop = threading.Thread(target=srv.run, daemon=True)
        loop.start()
        admin = ManagerClient(endpoint, identity="admin", role="admin", timeout_s=120)
        inline = srv.checks.inline_blocks
        runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for path in ("old", "new"):
                srv.checks.inline_blocks = 1 << 62 if path == "old" else inline
                runs[path].append(one_check(endpoint, admin))
        admin.close()
        srv.request_stop()
        loop.join(30)
    med = {p: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for p, rs in runs.items()}
    out = {"blocks": args.blocks, "requests": requests, "rounds": args.rounds,
           "old_check_s": med["old"][0], "old_stall_s": med["old"][1],
           "new_check_s": med["new"][0], "new_stall_s": med["new"][1],
           "stall_ratio": med["old"][1] / med["new"][1], "loadavg": os.getloadavg()}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.blocks} blocks, {requests} live requests; median of {args.rounds} interleaved rounds; "
          f"load {out['loadavg'][0]:.2f}")
    print(f"old (loop checks block by block): check {med['old'][0] * 1e3:8.1f} ms, longest heartbeat "
          f"{med['old'][1] * 1e3:8.1f} ms")
    print(f"new (forked child, bulk):         check {med['new'][0] * 1e3:8.1f} ms, longest heartbeat "
          f"{med['new'][1] * 1e3:8.1f} ms")
    print(f"loop stall: {out['stall_ratio']:.1f}x shorter")


if __name__ == "__main__":
    main()
