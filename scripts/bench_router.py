#!/usr/bin/env python3
"""KV-aware routing against round-robin and least-loaded, behind one front door, in one run.

Like ``vllm bench serve``: a load generator streams OpenAI chat completions at a running front
door (`kvpool serve`, here in this process) over several CPU workers. The trace is multi-tenant:
every tenant has its own long system prompt and cache salt, and the tenants' prefixes together
need more blocks than one worker's pool holds but fit in all of them. Each policy replays the
same trace against the same workers, their prefix caches reset (after a warm-up) before each:

  kv-aware          the documented cost (frontend/router.py): blocks to compute against blocks
                    busy, the prompts already routed to a worker and running counted as its hits
  kv-aware-located  the same cost on the manager's locate alone (a burst that arrives before its
                    first prompt is computed sees nothing cached)
  round-robin       the next worker, whatever it caches
  least-loaded      the worker with the fewest running requests

Reported per policy: prefix hit rate (cached prompt tokens over prompt tokens, counted by the
workers), time to first token (mean, p50, p99, measured at the client), generated tokens/s; and
the two ratios against round-robin measured in the same run (targets: hit rate >= 1.5x, mean
TTFT <= 0.6x), and the same two of kv-aware against kv-aware-located.

    python scripts/bench_router.py                     # 3 workers, small preset, 12 tenants
    python scripts/bench_router.py --model tiny --requests 120 --json
    python scripts/bench_router.py --url http://127.0.0.1:8000 --model tiny   # a running front door
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from kvpool.client.manager import ManagerClient
from kvpool.frontend.demo import worker_stats
from kvpool.frontend.loadgen import ChatTraceConfig, chat_trace, drive, summarize
from kvpool.frontend.procs import LocalCluster
from kvpool.frontend.server import FrontDoorServer
from kvpool.frontend.service import FrontDoorConfig
from kvpool.shared.protocol import ManagerError

# name -> (the front door's policy, count routed prompts as hits)
POLICIES = {"kv-aware": ("kv-aware", True), "kv-aware-located": ("kv-aware", False),
            "round-robin": ("round-robin", False), "least-loaded": ("least-loaded", False)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--model", default="small")
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--system-words", type=int, nargs=2, default=(50, 60), help="~7 tokens a word")
    ap.add_argument("--user-words", type=int, nargs=2, default=(4, 12))
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 24))
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--max-inflight", type=int, default=12)
    ap.add_argument("--kv-overlap-weight", type=float, default=2.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None, help="Drive a running front door (its own policy) instead; no comparison")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def reset_caches(manager: str, pools: list[str], timeout_s: float = 30.0) -> None:
    """Empties every pool's prefix cache; a worker frees a finished request's blocks with its
    next step, so a pool may still be in use for a moment after the last stream ended."""
    deadline = time.monotonic() + timeout_s
    with ManagerClient(manager, role="admin") as admin:
        for pool in pools:
            while True:
                try:
                    admin.call("reset_cache", pool=pool)
                    break
                except ManagerError as e:
                    if e.code != "in_use" or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def run_policy(args: argparse.Namespace, manager: str, policy: str, trace: list, warmup: list) -> dict:
    name, count_routed = POLICIES[policy]
    fd = FrontDoorServer(FrontDoorConfig((manager,), name, args.kv_overlap_weight, poll_s=0.2,
                                         count_routed=count_routed)).start()
    try:
        fd.wait_for_workers(args.model, args.workers, timeout_s=180)
        asyncio.run(drive(fd.url, args.model, warmup, max_inflight=args.max_inflight, salted=False))
        pools = sorted(w.pool for w in fd.frontdoor.directory.workers.values())
        reset_caches(manager, pools)
        before = worker_stats(fd)
        results, elapsed = asyncio.run(drive(fd.url, args.model, trace, max_inflight=args.max_inflight,
                                             progress=not args.json))
        after = worker_stats(fd)
    finally:
        fd.stop()
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before))
    out = summarize(results, elapsed)
    out.update(policy=policy, hit_rate=round(cached / prompt, 4) if prompt else 0.0,
               per_worker=dict(fd.frontdoor.router.per_worker))
    return out


def table(rows: list[dict]) -> str:
    head = f"{'policy':<17} {'hit rate':>9} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'tokens/s':>9} {'failed':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:<17} {r['hit_rate']:>9.1%} {r['ttft_mean_s'] * 1e3:>8.0f}ms "
                     f"{r['ttft_p50_s'] * 1e3:>6.0f}ms {r['ttft_p99_s'] * 1e3:>6.0f}ms {r['tokens_per_s']:>9.0f} "
                     f"{r['failed']:>7}")
    return "\n".join(lines)


def ratio(rows: list[dict], a: str, b: str) -> dict:
    """Hit rate and mean TTFT of policy ``a`` over policy ``b`` (both from this run)."""
    by = {r["policy"]: r for r in rows}
    if a not in by or b not in by:
        return {}
    x, y = by[a], by[b]
    hit = x["hit_rate"] / y["hit_rate"] if y["hit_rate"] else float("inf")
    ttft = x["ttft_mean_s"] / y["ttft_mean_s"] if y["ttft_mean_s"] else 0.0
    return {"hit_rate": round(hit, 2), "mean_ttft": round(ttft, 2)}


def ratios(rows: list[dict]) -> dict:
    out = {}
    rr = ratio(rows, "kv-aware", "round-robin")
    if rr:
        out |= {"hit_rate_vs_round_robin": rr["hit_rate"], "mean_ttft_vs_round_robin": rr["mean_ttft"],
                "targets_met": rr["hit_rate"] >= 1.5 and rr["mean_ttft"] <= 0.6}
    loc = ratio(rows, "kv-aware", "kv-aware-located")
    if loc:
        out |= {"hit_rate_vs_located": loc["hit_rate"], "mean_ttft_vs_located": loc["mean_ttft"]}
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    policies = args.policies.split(",")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    cfg = ChatTraceConfig(num_requests=args.requests, num_tenants=args.tenants, system_words=tuple(args.system_words),
                      user_words=tuple(args.user_words), max_tokens=tuple(args.max_tokens), parallel_every=0,
                      seed=args.seed)
    trace = chat_trace(cfg)
    warmup = chat_trace(ChatTraceConfig(num_requests=2 * args.workers, num_tenants=1, system_words=(4, 8),
                                    max_tokens=(2, 4), parallel_every=0, seed=args.seed + 1))
    if args.url:
        results, elapsed = asyncio.run(drive(args.url, args.model, trace, max_inflight=args.max_inflight,
                                             progress=not args.json))
        row = {**summarize(results, elapsed), "policy": "(running)", "hit_rate": float("nan")}
        print(json.dumps(row, indent=2) if args.json else table([row]) + "\n(hit rate: the workers' counts "
              f"are not reachable from here; routed estimate {row['routed_hit_rate']:.1%})")
        return 0
    cluster = LocalCluster(prefix="kvpool-bench-router-")
    try:
        manager = cluster.manager()
        for k in range(args.workers):
            cluster.worker(manager, f"bench-{k}", model=args.model, kv_blocks=args.kv_blocks,
                           max_model_len=args.max_model_len, seed=args.seed)
        rows = [run_policy(args, manager, p, trace, warmup) for p in policies]
    finally:
        cluster.stop()
    result = {"config": vars(args), "policies": rows, **ratios(rows)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.requests} chat requests, {args.tenants} tenants, {args.workers} {args.model} CPU workers of "
          f"{args.kv_blocks} blocks, {args.max_inflight} in flight")
    print(table(rows))
    r = ratios(rows)
    if "targets_met" in r:
        print(f"kv-aware vs round-robin: hit rate {r['hit_rate_vs_round_robin']:.2f}x (target >= 1.5x), "
              f"mean TTFT {r['mean_ttft_vs_round_robin']:.2f}x (target <= 0.6x): "
              f"{'met' if r['targets_met'] else 'NOT met'}")
    if "hit_rate_vs_located" in r:
        print(f"kv-aware vs kv-aware-located (routed prompts counted or not): hit rate "
              f"{r['hit_rate_vs_located']:.2f}x, mean TTFT {r['mean_ttft_vs_located']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
