"""`kvpool demo`: a manager, two CPU workers and the front door; a multi-tenant chat trace sent
through HTTP (OpenAI chat completions, streamed), a few sample completions and the report.

The presets have seeded random weights, so the completions are gibberish; the point is the path:
text -> chat template -> tokens -> KV-aware routing (each tenant's system prompt is cached in one
pool; tenants are kept apart by their cache salt) -> paged KV blocks -> streamed text.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

from kvpool.bench.workload import chat_messages
from kvpool.client.generate import GenerateClient
from kvpool.devcluster.cluster import DevCluster
from kvpool.devcluster.loadgen import ChatTraceConfig, Result, chat_trace, drive, summarize
from kvpool.frontend.server import FrontDoorServer
from kvpool.frontend.service import FrontDoorConfig

SAMPLES = 3


@dataclass(frozen=True)
class TextDemoConfig:
    trace: ChatTraceConfig = ChatTraceConfig()
    num_workers: int = 2
    max_inflight: int = 32
    kv_blocks: int = 128  # per worker
    max_model_len: int = 512  # per worker; also what a static allocator would reserve per request
    policy: str = "kv-aware"
    model: str = "tiny"
    host_kv_memory: int = 0  # bytes of host tier per worker (--host-kv-memory); 0: none
    node_tier_memory: int = 0  # bytes of the manager's node tier the workers share (--node-tier-memory); 0: none

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.max_inflight < 1 or self.kv_blocks < 8:
            raise ValueError("need num_workers >= 1, max_inflight >= 1 and kv_blocks >= 8")


def worker_stats(fd: FrontDoorServer) -> list[dict]:
    out = []
    for w in sorted(fd.frontdoor.directory.workers.values(), key=lambda w: w.name):
        client = GenerateClient(w.endpoint)
        try:
            out.append(client.stats(timeout_s=10))
        finally:
            client.close()
    return out


def host_tier_stats(manager: str) -> dict:
    """Per pool, the manager's count of hits by tier and of host-tier copies."""
    from kvpool.client.manager import ManagerClient

    client = ManagerClient(manager)
    try:
        pools = client.stats()["pools"]
    finally:
        client.close()
    return {name: {**{k: p.get(k, 0) for k in ("hit_tokens", "host_hit_tokens", "lookup_tokens", "host_num_blocks",
                                               "host_cached_blocks", "host_saves", "host_loads",
                                               "node_host_hit_tokens", "node_disk_hit_tokens")},
                   "node": "node_hit_tokens" in p}
            for name, p in sorted(pools.items())}


def say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def run_text_demo(cfg: TextDemoConfig, progress: bool = True) -> dict:
    """Runs the demo; with ``progress`` says on stderr what starts and how far it got."""
    cluster = DevCluster(prefix="kvpool-demo-")
    fd = None
    say(progress, f"starting a manager, {cfg.num_workers} CPU workers (model {cfg.model!r}: seeded random weights, "
                  f"{cfg.kv_blocks} KV blocks each) and the HTTP front door ({cfg.policy} routing)")
    say(progress, "waiting for the workers to load the model and register their pools (about 10 s)...")
    t0 = time.monotonic()
    previous = _quiet_on_interrupt()
    try:
        node = ("--node-tier-memory", str(cfg.node_tier_memory), "--node-tier-dir", cluster.dir)
        manager = cluster.manager("manager", *(node if cfg.node_tier_memory else ()))
        for k in range(cfg.num_workers):
            cluster.worker(manager, f"demo-{k}", model=cfg.model, kv_blocks=cfg.kv_blocks,
                           max_model_len=cfg.max_model_len, seed=cfg.trace.seed,
                           extra=("--host-kv-memory", str(cfg.host_kv_memory)) if cfg.host_kv_memory else ())
        fd = FrontDoorServer(FrontDoorConfig((manager,), cfg.policy, poll_s=0.2)).start()
        try:
            fd.wait_for_workers(cfg.model, cfg.num_workers, timeout_s=120)
        except RuntimeError:
            cluster.check_alive()
            raise
        trace = chat_trace(cfg.trace)
        say(progress, f"ready in {time.monotonic() - t0:.1f}s; sending {len(trace)} chat requests over HTTP, up to "
                      f"{cfg.max_inflight} at once")
        results, elapsed = asyncio.run(drive(fd.url, cfg.model, trace, max_inflight=cfg.max_inflight,
                                             progress=progress))
        out = report(cfg, trace, results, elapsed, fd)
        if cfg.host_kv_memory or cfg.node_tier_memory:
            out["host_tier"] = host_tier_stats(manager)
        return out
    finally:
        if fd is not None:
            fd.stop()
        cluster.stop()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _interrupted(signum, frame) -> None:
    # The front door runs in this process: the streams a Ctrl-C cuts make it log every broken
    # write and request while it shuts down, noise for a demo that is stopping anyway.
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    raise KeyboardInterrupt


def _quiet_on_interrupt():
    """Installs the Ctrl-C handler above (main thread only); returns the one it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, _interrupted)


def report(cfg: TextDemoConfig, trace: list, results: list[Result], elapsed: float, fd: FrontDoorServer) -> dict:
    stats = worker_stats(fd)
    prompt = sum(s["prompt_tokens"] for s in stats)
    router = fd.frontdoor.router
    samples = [{"tenant": r.tenant, "user": chat_messages(trace[i])[-1]["content"], "completion": r.texts[0],
                "worker": r.worker} for i, r in enumerate(results[:SAMPLES])]
    return {
        "config": asdict(cfg), **summarize(results, elapsed),
        "prefix_hit_rate": round(sum(s["cached_tokens"] for s in stats) / prompt, 4) if prompt else 0.0,
        "routing": {"policy": router.policy, "by_reason": dict(router.decisions), "per_worker": dict(router.per_worker)},
        "pools": [pool_report(s, cfg.max_model_len) for s in stats],
        "samples": samples,
    }


def pool_report(stats: dict, max_model_len: int) -> dict:
    """One worker's pool figures, with what reserving max_model_len per running request (a static
    allocator) would have taken at the same peak: paging's saving."""
    per_request = -(-max_model_len // stats["block_size"])
    return {"pool": stats["pool"], "num_blocks": stats["num_blocks"], "peak_blocks": stats["peak_blocks"],
            "peak_running": stats["peak_running"], "static_blocks": stats["peak_running"] * per_request,
            "preemptions": stats["preemptions"]}


def format_report(r: dict) -> str:
    lines = ["sample completions (seeded random weights: the text is gibberish by design; the path is real)"]
    for s in r["samples"]:
        lines.append(f"  tenant {s['tenant']} on {s['worker']}: {s['user'][:40]!r} -> {s['completion'][:48]!r}")
    routing = r["routing"]
    lines += [
        "",
        f"requests            {r['requests']} over HTTP in {r['elapsed_s']:.2f}s ({r['failed']} failed)",
        f"generated tokens    {r['generated_tokens']}  ({r['tokens_per_s']:.0f} tokens/s)",
        f"time to first token p50 {r['ttft_p50_s'] * 1000:.0f} ms, p99 {r['ttft_p99_s'] * 1000:.0f} ms",
        f"prefix-cache hits   {r['prefix_hit_rate']:.1%} of prompt tokens (workers' count)",
        f"routing ({routing['policy']}) by reason {routing['by_reason']}; per worker {routing['per_worker']}",
    ]
    for p in r["pools"]:
        ratio = p["static_blocks"] / p["peak_blocks"] if p["peak_blocks"] else 0.0
        lines.append(f"pool {p['pool']:<10} peak {p['peak_blocks']} of {p['num_blocks'] - 1} blocks in use for "
                     f"{p['peak_running']} running (static max-length preallocation: {p['static_blocks']} blocks, "
                     f"{ratio:.1f}x); {p['preemptions']} preemptions")
    for name, t in r.get("host_tier", {}).items():
        lines.append(tier_line(name, t))
    return "\n".join(lines + ["", *EXPLAIN])


def tier_line(name: str, t: dict) -> str:
    """A pool's hits by tier (and by node-tier level, with a node tier)."""
    look = t["lookup_tokens"] or 1
    node = t["node_host_hit_tokens"] + t["node_disk_hit_tokens"]
    device = t["hit_tokens"] - t["host_hit_tokens"] - node
    held = f"host tier {t['host_cached_blocks']}/{t['host_num_blocks'] - 1} blocks cached; " if t["host_num_blocks"] else ""
    if not t["node"]:
        return (f"pool {name:<10} {held}hits {device / look:.1%} device + {t['host_hit_tokens'] / look:.1%} host; "
                f"{t['host_saves']} saves, {t['host_loads']} loads")
    return (f"pool {name:<10} {held}hits {device / look:.1%} device + {t['host_hit_tokens'] / look:.1%} host + "
            f"{t['node_host_hit_tokens'] / look:.1%} node host + {t['node_disk_hit_tokens'] / look:.1%} node disk; "
            f"{t['host_saves']} host saves, {t['host_loads']} host loads")


EXPLAIN = [
    "what the figures mean:",
    "  tokens/s            tokens sampled per second by all workers together, on CPU with a tiny model",
    "  time to first token from sending a request to its first streamed token, as a client sees it",
    "  prefix-cache hits   prompt tokens whose KV blocks were found cached (shared prompts) and not recomputed",
    "  routing             why the front door chose each worker (cached prefix, load, ...) and how many each got",
    "  peak ... blocks     the most KV blocks in use at once out of the pool; 'static': what reserving",
    "                      max_model_len per running request would have needed (paging's saving)",
    "  preemptions         requests paused and recomputed later because their pool ran out of free blocks",
    "  host tier           (--host-kv-memory) blocks evicted from the device kept in host memory: hits by tier,",
    "                      device blocks saved to host and prefix blocks loaded back instead of recomputed",
    "  node host/disk      (--node-tier-memory) the manager's node tier both workers share: a prefix one",
    "                      worker computed, loaded by the other instead of recomputed",
]
