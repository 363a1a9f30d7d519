"""bench_tier.py's node-tier part: the real worker (CPU, fp32) over the tier stack, and two pools
sharing a node tier (scripts/bench_tier.py prints them).

Stack: one trace (P shared prefixes, their set several times the device pool, visited in a
cycle), served by device only, then + the private host tier, + the node tier's host level,
+ its disk level. The node tier's bookkeeping is the manager's core (manager/core/node_tier.py,
in process, as LocalBlockManager runs the pool core); its bytes go through the real stores
(worker/node_store.py: a file under /dev/shm, one fsynced file per disk block) with every read
verified. Printed per row: hit rate by level, prompt tokens computed, tokens/s (wall and per
CPU-second), identical greedy output.

Sharing: pool A computes a long prompt; pool B, on the same node tier, serves the same prefix
with another suffix; its time to first token against pool C's, which has no node tier and
recomputes it (each pool on its own device blocks, the same model).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager

import torch

from kvpool.manager.core.node_tier import NodeTier
from kvpool.shared.node_tier import NodeTierInfo, disk_slots, host_slots, host_stride, layout_id
from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig, model_identity
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.request import SamplingParams
from kvpool.worker.startup import build_engine

BLOCK = 16


@contextmanager
def stores():
    """A host-level directory under /dev/shm (where the manager puts it) and a disk directory."""
    shm = tempfile.mkdtemp(prefix="kvpool-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="kvpool-bench-disk-")
    try:
        yield shm, disk
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def node_tier(model: str, node_host: int, disk: int, where: tuple[str, str], max_model_len: int,
              policy: str = "demote") -> tuple[NodeTier, NodeTierInfo]:
    """A node tier of ``node_host`` host blocks (and ``disk`` disk blocks) for ``model``'s layout."""
    spec = kv_spec(PRESETS[model], BLOCK, torch.float32)
    bb = spec.block_bytes
    slots = host_slots(bb, (node_host + 1) * host_stride(bb))
    dslots = disk_slots(bb, disk * (64 + bb)) if disk else 0
    layout = layout_id(spec, model_identity(model, 0)).hex()
    info = NodeTierInfo(layout, where[0], slots, where[1] if disk else None, disk * (64 + bb) if disk else 0, dslots,
                        policy)
    return NodeTier(slots, dslots, BLOCK, bb, policy=policy), info


def engine(model: str, pool: str, device_blocks: int, max_model_len: int, host_blocks: int = 0,
           tier: tuple[NodeTier, NodeTierInfo] | None = None):
    bb = kv_spec(PRESETS[model], BLOCK, torch.float32).block_bytes
    cfg = WorkerConfig(model=model, dtype="float32", device="cpu", block_size=BLOCK, max_model_len=max_model_len,
                       kv_cache_memory=device_blocks * bb, host_kv_memory=host_blocks * bb)
    return build_engine(cfg, LocalBlockManager(pool, max_blocks=device_blocks, node_tier=tier))


def serve_stack(model: str, prompts: list[list[int]], device: int, host: int, node_host: int, disk: int,
                max_tokens: int, run_waves) -> dict:
    """One row of the stack table: the trace served by one worker with the given levels."""
    max_model_len = 1 << (max(len(p) for p in prompts) + max_tokens - 1).bit_length()
    with stores() as where:
        tier = node_tier(model, node_host, disk, where, max_model_len) if node_host else None
        e = engine(model, "bench", device, max_model_len, host, tier)
        params = SamplingParams(max_tokens=max_tokens)
        e.generate([prompts[0][:BLOCK + 1]], params)  # warm-up: nothing of the trace cached
        pool = e.bm.core
        s0 = (pool.stats.lookup_tokens, pool.stats.hit_tokens, e.stats()["computed_tokens"],
              pool.host.stats.hit_tokens if pool.host else 0, dict(pool.node.hit_tokens) if pool.node else {},
              e.stats().get("node_copy_s", 0.0), e.runner.host_copies.wall_s)
        cpu, t0 = time.process_time(), time.perf_counter()
        outs, _ = run_waves(e, prompts, 2, params, lambda: None)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
        lookup, hits = pool.stats.lookup_tokens - s0[0], pool.stats.hit_tokens - s0[1]
        host_hits = (pool.host.stats.hit_tokens if pool.host else 0) - s0[3]
        nh = pool.node.hit_tokens["host"] - s0[4].get("host", 0) if pool.node else 0
        nd = pool.node.hit_tokens["disk"] - s0[4].get("disk", 0) if pool.node else 0
        st = e.stats()
        tokens = sum(len(p) for p in prompts) + sum(len(o) for o in outs)
        return {"device_blocks": device, "host_blocks": host, "node_host_blocks": node_host, "disk_blocks": disk,
                "hit_rate": hits / lookup, "device": (hits - host_hits - nh - nd) / lookup, "host": host_hits / lookup,
                "node_host": nh / lookup, "node_disk": nd / lookup,
                "prompt_tokens_computed": st["computed_tokens"] - s0[2], "tokens_per_s": tokens / wall,
                "tokens_per_cpu_s": tokens / cpu, "verify_failures": sum(st.get("node_failures", {}).values()),
                "wall_s": wall, "node_copy_s": st.get("node_copy_s", 0.0) - s0[5],
                "host_copy_s": e.runner.host_copies.wall_s - s0[6],
                "outputs": outs}


def stack_trace(prefixes: int, prefix_blocks: int, rounds: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Rounds over P shared prefixes, each round in its own random order, each request a prefix
    and a short unique suffix: a level that holds a share of the set serves about that share."""
    import random

    rng = random.Random(seed)
    shared = [[rng.randrange(2, vocab) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    out = []
    for _ in range(rounds):
        order = list(range(prefixes))
        rng.shuffle(order)
        out += [shared[i] + [rng.randrange(2, vocab) for _ in range(7)] for i in order]
    return out


def stack_configs(device: int, set_blocks: int) -> dict[str, tuple[int, int, int]]:
    """(private host, node host, disk) blocks of each row: each level alone holds a share of the
    set (the private host as much as the device, the node host half the set), the disk all of it."""
    host, node_host = device, set_blocks // 2
    return {"device only": (0, 0, 0), "+ private host": (host, 0, 0), "+ node host": (host, node_host, 0),
            "+ disk": (host, node_host, 2 * set_blocks)}


def first_token_s(e, prompt: list[int]) -> float:
    """Seconds from a request's arrival to its first token (the engine otherwise idle)."""
    t0 = time.perf_counter()
    e.add_request(prompt, SamplingParams(max_tokens=2))
    first = None
    while e.has_work():
        for ev in e.step():
            if ev.token is not None and first is None:
                first = time.perf_counter() - t0
    return first  # type: ignore[return-value]


def shared_ttft(model: str, prefix_tokens: int, repeats: int, vocab: int, seed: int = 1) -> dict:
    """Pool B's TTFT on a prefix pool A computed, through the node tier, against pool C's
    recompute of the same prompt; medians of ``repeats`` prefixes, B and C in turn."""
    import random

    rng = random.Random(seed)
    blocks = prefix_tokens // BLOCK + 8
    max_model_len = 1 << (prefix_tokens + 64).bit_length()
    shared, alone, loaded = [], [], []
    with stores() as where:
        tier = node_tier(model, 2 * blocks * repeats, 0, where, max_model_len)
        a, b = (engine(model, name, blocks * 2, max_model_len, 0, tier) for name in ("a", "b"))
        c = engine(model, "c", blocks * 2, max_model_len)
        first_token_s(c, [3, 4, 5])  # each engine's first forward is slower: not timed
        first_token_s(b, [3, 4, 6])
        for _ in range(repeats):
            prefix = [rng.randrange(2, vocab) for _ in range(prefix_tokens)]
            first_token_s(a, prefix + [rng.randrange(2, vocab) for _ in range(8)])
            while a.has_work():
                a.step()  # its reports: the blocks land for the others
            prompt = prefix + [rng.randrange(2, vocab) for _ in range(8)]
            before = b.stats()["cached_tokens"]
            shared.append(first_token_s(b, prompt))
            loaded.append(b.stats()["cached_tokens"] - before)
            alone.append(first_token_s(c, prompt))
    mid = repeats // 2
    return {"prefix_tokens": prefix_tokens, "ttft_shared_s": sorted(shared)[mid], "ttft_recompute_s": sorted(alone)[mid],
            "ratio": sorted(shared)[mid] / sorted(alone)[mid], "tokens_loaded": loaded[0]}


def report_stack(header: str, best: dict[str, dict], identical: dict[str, bool]) -> dict:
    """Prints the stack table (ratios against device only); returns the ratios."""
    dev = best["device only"]
    ratio = {k: {"tokens_per_s": r["tokens_per_s"] / dev["tokens_per_s"],
                 "tokens_per_cpu_s": r["tokens_per_cpu_s"] / dev["tokens_per_cpu_s"],
                 "identical_output": identical[k]} for k, r in best.items()}
    print(header)
    print(f"{'':16}{'hit':>6}{'dev':>6}{'host':>6}{'n-host':>7}{'n-disk':>7}{'computed':>9}{'tok/s':>7}"
          f"{'tok/cpu-s':>10}{'copy ms':>8}{'x tok/s':>8}{'x cpu':>6} same")
    for k, r in best.items():
        x = ratio[k]
        print(f"{k:16}{r['hit_rate']:6.2f}{r['device']:6.2f}{r['host']:6.2f}{r['node_host']:7.2f}{r['node_disk']:7.2f}"
              f"{r['prompt_tokens_computed']:9d}{r['tokens_per_s']:7.0f}{r['tokens_per_cpu_s']:10.0f}"
              f"{(r['node_copy_s'] + r['host_copy_s']) * 1000:8.0f}{x['tokens_per_s']:8.2f}"
              f"{x['tokens_per_cpu_s']:6.2f} {x['identical_output']}")
    full = ratio["+ disk"]
    print(f"full stack: {full['tokens_per_s']:.2f}x wall tokens/s, {full['tokens_per_cpu_s']:.2f}x per CPU-second of "
          f"device only (target >= 2x), identical greedy output: {full['identical_output']}")
    return ratio


def report_share(r: dict) -> None:
    print(f"two pools sharing the node tier, {r['prefix_tokens']}-token prefix computed by pool A: pool B's TTFT "
          f"{r['ttft_shared_s'] * 1000:.0f} ms ({r['tokens_loaded']} tokens loaded) against "
          f"{r['ttft_recompute_s'] * 1000:.0f} ms recomputed: {r['ratio']:.2f}x (target <= 0.5x)")
