#!/usr/bin/env python3
"""The front door's manager call per routed request (``locate``), in one run against one daemon:

  threads   (before) the sync ``ManagerClient`` in ``asyncio.to_thread`` under an asyncio lock,
            as frontend/directory.py called it up to the kvpool.client split
  asyncio   (after) ``AsyncManagerClient`` awaited on the event loop (client/manager_async.py)

Each way runs ``--calls`` locates one after the other, then the same number from ``--concurrent``
tasks at once (routed requests arriving together), the two ways alternating for ``--rounds``;
reported: the median microseconds per call and the ratio asyncio / threads (below 1: the new
path costs less).

    python scripts/bench_locate.py
    python scripts/bench_locate.py --calls 5000 --concurrent 32 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from manager_daemon import start_daemon

from kvpool.client.manager import ManagerClient
from kvpool.client.manager_async import AsyncManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.protocol import KVSpec

SPEC = {"block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}


async def timed(call, calls: int, concurrent: int) -> float:
    """Seconds per call over ``calls`` calls made by ``concurrent`` tasks."""
    async def task(n: int) -> None:
        for _ in range(n):
            await call()

    t0 = time.perf_counter()
    await asyncio.gather(*(task(calls // concurrent) for _ in range(concurrent)))
    return (time.perf_counter() - t0) / (calls // concurrent * concurrent)


async def compare(endpoint: str, chain: list[bytes], calls: int, concurrent: int, rounds: int) -> dict:
    sync = ManagerClient(endpoint, role="router", timeout_s=2.0, failover_s=2.0)
    lock = asyncio.Lock()

    async def threads() -> None:
        async with lock:
            await asyncio.to_thread(sync.locate, chain)

    aio = AsyncManagerClient(endpoint, role="router", timeout_s=2.0, failover_s=2.0)

    async def direct() -> None:
        await aio.locate(chain)

    ways = {"threads": threads, "asyncio": direct}
    got: dict[str, list[float]] = {}
    try:
        for call in ways.values():
            await timed(call, 200, 1)  # warm-up: hello, socket, caches
        for _ in range(rounds):  # the two ways alternate: a burst of load elsewhere hits both
            for way, call in ways.items():
                for tasks in (1, concurrent):
                    got.setdefault(f"{way}_x{tasks}_us", []).append(await timed(call, calls, tasks) * 1e6)
    finally:
        await aio.deregister()
        aio.close()
        sync.deregister()
        sync.close()
    out = {key: statistics.median(values) for key, values in got.items()}
    for tasks in (1, concurrent):
        out[f"ratio_x{tasks}"] = out[f"asyncio_x{tasks}_us"] / out[f"threads_x{tasks}_us"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median is reported")
    ap.add_argument("--blocks", type=int, default=32, help="hashes in each locate (a prompt of N blocks)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        endpoint = f"ipc://{d}/m.sock"
        daemon = start_daemon(endpoint, 60, quiet=True)
        try:
            with ManagerClient(endpoint, role="worker", identity="bench") as w:
                w.register("p", shard_rank=0, shard_count=1, incarnation="bench", spec=SPEC,
                           available_kv_bytes=1024 * KVSpec.from_wire(SPEC).block_bytes)
                chain = hash_blocks(list(range(args.blocks * 16)), 16)
                out = asyncio.run(compare(endpoint, chain, args.calls, args.concurrent, args.rounds))
        finally:
            daemon.terminate()
            daemon.wait(10)
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    for tasks in (1, args.concurrent):
        print(f"{tasks:>3} at once: threads {out[f'threads_x{tasks}_us']:7.1f} us/call, asyncio "
              f"{out[f'asyncio_x{tasks}_us']:7.1f} us/call: {out[f'ratio_x{tasks}']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
