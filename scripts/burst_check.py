#!/usr/bin/env python3
"""A burst through the front door: every request answered or refused, no load left behind.

A manager, ``--workers`` CPU workers (the tiny preset) and `kvpool serve`; ``--requests``
completions sent at once (one connection each), then, once the clients are done:

- how each ended: 200, an HTTP error status (refused: which), or no answer within
  ``--timeout`` (the failure this check exists for);
- the front door's `kvpool_frontdoor_worker_running` against what each worker's own ``stats``
  says is open, both once the load has drained (they must agree: no phantom load).

    .venv/bin/python scripts/burst_check.py                      # 2,000 requests, two workers
    .venv/bin/python scripts/burst_check.py --requests 500 --json

Exits 1 when a request got no answer or the counts disagree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from collections import Counter

import httpx

from kvpool.client.generate import GenerateClient
from kvpool.devcluster.cluster import ClusterConfig, DevCluster
from kvpool.shared.procs import CLI


async def burst(url: str, n: int, max_tokens: int, timeout: float) -> Counter:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        async def one(i: int) -> str:
            try:
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": f"burst {i} " * (i % 7 + 1),
                                                          "max_tokens": max_tokens})
                return str(r.status_code)
            except httpx.TimeoutException:
                return "no answer"
            except httpx.TransportError as e:
                return f"connection: {type(e).__name__}"
        return Counter(await asyncio.gather(*(one(i) for i in range(n))))


def door_running(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^kvpool_frontdoor_worker_running\{worker="([^"]+)"\} (\S+)$', text, re.M)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0, help="a client waits this long for its answer")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cluster = DevCluster(ClusterConfig(num_workers=args.workers, kv_blocks=512), prefix="kvpool-burst-")
    door = None
    try:
        cluster.start()
        door = subprocess.Popen(CLI + ["serve", "-m", cluster.manager_ep, "--port", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        url = re.search(r"(http://\S+)/v1", door.stdout.readline()).group(1)
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.2)
        t0 = time.perf_counter()
        outcomes = asyncio.run(burst(url, args.requests, args.max_tokens, args.timeout))
        wall = time.perf_counter() - t0
        time.sleep(3.0)  # a heartbeat or two: whatever is still counted anywhere shows now
        door_counts = door_running(url)
        worker_counts = {}
        for pool, ep in zip(cluster.pools, cluster.worker_eps):
            g = GenerateClient(ep)
            try:
                stats = g.stats()
            finally:
                g.close()
            worker_counts[pool] = stats.get("running", 0) + stats.get("waiting", 0)
    finally:
        if door is not None:
            door.kill()
        cluster.stop()
    report = {"requests": args.requests, "wall_s": round(wall, 1), "outcomes": dict(outcomes),
              "door_running": door_counts, "worker_open": worker_counts}
    ok = outcomes.get("no answer", 0) == 0 and all(v == 0 for v in door_counts.values()) and \
        all(v == 0 for v in worker_counts.values())
    if args.json:
        print(json.dumps({**report, "ok": ok}, indent=1))
    else:
        print(f"{args.requests} completions at once through {args.workers} workers, {wall:.1f} s")
        for k, v in sorted(outcomes.items()):
            print(f"  {k:<24} {v}")
        print(f"  front door running per worker after: {door_counts}; the workers' own open counts: {worker_counts}")
        print("ok" if ok else "FAILED: a request went unanswered or load was left behind")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
