#!/usr/bin/env python3
"""The host tier's two policies against device only, on the real worker (CPU, fp32), in one run.

Trace: P shared prefixes of L blocks each, their set about 3x the device tier; rounds of requests,
each one prefix plus a short unique suffix, visited in a cycle (the pattern LRU on the device
alone cannot keep). Every configuration serves the same trace with the in-process manager (the
daemon's core and step executor):

  device only                  no host tier
  demote, host H               saves a cached block to the host tier when its device block is reused
  write-through, host H        writes every block to the host tier in the step it becomes full
  ... and both policies again with a small host tier (about twice the device tier: the set fits
  device + host, not the host alone)

Printed per configuration: prefix hit rate by tier, prompt tokens computed, end-to-end
throughput (prompt + output tokens per second of wall time, and per second of this process's
CPU time, which a shared machine disturbs less), copies per step (blocks and KiB, device -> host
and back), the time the worker spends in those copies per step (wall, which the step waits for:
the critical-path cost; and their share of the process's CPU time), and the host blocks holding
duplicates of device blocks (mean over steps); then ratios against device only and whether the
greedy outputs are identical.

Each configuration runs --repeats times, interleaved, on --threads torch threads; the run with
the median tokens per CPU-second of each is reported. Targets (the default policy, demote): hit
rate >= 2x device-only, tokens/s >= 1.3x, identical greedy output.

Then the node tier (scripts/tier_stack.py): the stack (device only, + private host, + node host,
+ disk) on one trace, and two pools sharing the node tier (pool B's time to first token on a
2k-token prefix pool A computed, against recomputing it). Targets: the full stack >= 2x device
only's tokens/s, identical greedy output; pool B <= 0.5x the recompute's TTFT.

    python scripts/bench_tier.py            # small preset
    python scripts/bench_tier.py --quick    # tiny preset, fewer rounds
    python scripts/bench_tier.py --only stack,share
    python scripts/bench_tier.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import tier_stack
import torch

from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.request import SamplingParams
from kvpool.worker.startup import build_engine

BLOCK = 16


def trace(prefixes: int, prefix_blocks: int, rounds: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(2, vocab) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    return [p + [rng.randrange(2, vocab) for _ in range(7)] for _ in range(rounds) for p in shared]


def run_waves(engine, prompts: list[list[int]], wave: int, params: SamplingParams, probe) -> tuple[list, float]:
    """The trace in waves of ``wave`` requests, ``probe()`` after every step (its time returned)."""
    outs, probe_s = [], 0.0
    for i in range(0, len(prompts), wave):
        ids = [engine.add_request(p, params) for p in prompts[i:i + wave]]
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        while engine.has_work():
            for ev in engine.step():
                if ev.token is not None:
                    got[ev.request_id].append(ev.token)
            t = time.perf_counter()
            probe()
            probe_s += time.perf_counter() - t
        outs += [got[rid] for rid in ids]
    return outs, probe_s


def serve(model: str, prompts: list[list[int]], device_blocks: int, host_blocks: int, policy: str,
          max_tokens: int) -> dict:
    max_model_len = 1 << (max(len(p) for p in prompts) + max_tokens - 1).bit_length()
    block_bytes = kv_spec(PRESETS[model], BLOCK, torch.float32).block_bytes
    cfg = WorkerConfig(model=model, dtype="float32", device="cpu", block_size=BLOCK, max_model_len=max_model_len,
                       kv_cache_memory=device_blocks * block_bytes, host_kv_memory=host_blocks * block_bytes,
                       host_kv_policy=policy)
    engine = build_engine(cfg, LocalBlockManager("bench", max_blocks=device_blocks))
    params = SamplingParams(max_tokens=max_tokens)
    engine.generate([prompts[0][:BLOCK + 1]], params)  # warm-up: nothing of the trace cached
    pool, host = engine.bm.core, engine.bm.core.host
    copies = engine.runner.host_copies
    s0, st0 = pool.stats, engine.stats()
    base = (s0.lookup_tokens, s0.hit_tokens, st0["computed_tokens"], st0["steps"],
            host.stats.hit_tokens if host else 0, copies.saves + copies.loads + copies.writes, copies.wall_s,
            copies.cpu_s)
    ordered0 = _ordered(host)
    dups = [0, 0]  # sum over steps, max

    def probe() -> None:
        if host is not None:
            n = len(pool.blocks.cached.keys() & host.blocks.cached.keys())
            dups[0] += n
            dups[1] = max(dups[1], n)

    cpu, t0 = time.process_time(), time.perf_counter()
    outs, probe_s = run_waves(engine, prompts, 2, params, probe)
    wall, cpu = time.perf_counter() - t0 - probe_s, time.process_time() - cpu
    steps = engine.stats()["steps"] - base[3]
    lookup, hits = pool.stats.lookup_tokens - base[0], pool.stats.hit_tokens - base[1]
    host_hits = (host.stats.hit_tokens if host else 0) - base[4]
    ordered = {k: v - ordered0[k] for k, v in _ordered(host).items()}
    blocks_copied = copies.saves + copies.loads + copies.writes - base[5]
    tokens = sum(len(p) for p in prompts) + sum(len(o) for o in outs)
    return {"policy": policy if host_blocks else "-", "device_blocks": device_blocks, "host_blocks": host_blocks,
            "hit_rate": hits / lookup, "device_hit_rate": (hits - host_hits) / lookup,
            "host_hit_rate": host_hits / lookup, "prompt_tokens_computed": engine.stats()["computed_tokens"] - base[2],
            "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu, "wall_s": wall, "cpu_s": cpu,
            "steps": steps,
            **ordered,
            "copies_per_step": blocks_copied / steps, "copy_kib_per_step": blocks_copied * block_bytes / steps / 1024,
            "copy_ms_per_step": (copies.wall_s - base[6]) * 1000 / steps,
            "copy_cpu_share": (copies.cpu_s - base[7]) / cpu,
            "host_dup_blocks_mean": dups[0] / steps, "host_dup_blocks_max": dups[1], "outputs": outs}


def _ordered(host) -> dict[str, int]:
    """Host-tier copies the manager ordered so far, by kind."""
    s = host.stats if host is not None else None
    return {"saves": s.saves if s else 0, "writes": s.writes if s else 0, "loads": s.loads if s else 0}


def configs(device_blocks: int, set_blocks: int) -> dict[str, tuple[int, str]]:
    large, small = set_blocks + 16, 2 * device_blocks + 4  # small: the set fits device + host only
    return {"device only": (0, "demote"), "demote": (large, "demote"), "write-through": (large, "write_through"),
            "demote, small host": (small, "demote"), "write-through, small": (small, "write_through")}


def report(model: str, header: str, best: dict[str, dict], identical: dict[str, bool], as_json: bool) -> None:
    dev = best["device only"]
    ratio = {k: {"hit_rate": r["hit_rate"] / max(dev["hit_rate"], 1e-9),
                 "tokens_per_s": r["tokens_per_s"] / dev["tokens_per_s"],
                 "tokens_per_cpu_s": r["tokens_per_cpu_s"] / dev["tokens_per_cpu_s"],
                 "identical_output": identical[k]} for k, r in best.items()}
    load = os.getloadavg()
    if as_json:
        print(json.dumps({"model": model, "loadavg": load, "configs": best, "ratio": ratio}, indent=2))
        return
    print(header)
    print(f"{'':22}{'hit':>5}{'dev':>5}{'host':>5}{'computed':>9}{'tok/s':>7}{'tok/cpu-s':>10}{'blk/st':>7}"
          f"{'KiB/st':>7}{'ms/st':>6}{'copy%':>6}{'dup':>6}{'x tok/s':>8}{'x cpu':>6} same")
    for k, r in best.items():
        x = ratio[k]
        print(f"{k:22}{r['hit_rate']:5.2f}{r['device_hit_rate']:5.2f}{r['host_hit_rate']:5.2f}"
              f"{r['prompt_tokens_computed']:9d}{r['tokens_per_s']:7.0f}{r['tokens_per_cpu_s']:10.0f}"
              f"{r['copies_per_step']:7.2f}{r['copy_kib_per_step']:7.0f}{r['copy_ms_per_step']:6.2f}"
              f"{r['copy_cpu_share']:6.1%}{r['host_dup_blocks_mean']:6.1f}{x['tokens_per_s']:8.2f}"
              f"{x['tokens_per_cpu_s']:6.2f} {x['identical_output']}")
    d = ratio["demote"]
    print(f"default (demote): hit rate {best['demote']['hit_rate']:.2f} against {dev['hit_rate']:.2f} "
          f"(target >= 2x), tokens/s {d['tokens_per_s']:.2f}x wall, {d['tokens_per_cpu_s']:.2f}x per CPU-second "
          f"(target >= 1.3), identical greedy output: {d['identical_output']}; load average {load[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration (median tokens/CPU-s)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--only", default="policies,stack,share",
                    help="comma-separated parts: policies (the host tier's), stack, share (the node tier's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.only.split(","))
    if "policies" in parts:
        policies(args)
    if "stack" in parts:
        stack(args)
    if "share" in parts:
        r = tier_stack.shared_ttft("small", 1024 if args.quick else 2048, args.repeats, PRESETS["small"].vocab_size)
        print(json.dumps({"share": r}, indent=2) if args.json else "", end="")
        if not args.json:
            tier_stack.report_share(r)


def stack(args: argparse.Namespace) -> None:
    model = "tiny" if args.quick else "small"
    prefixes, prefix_blocks, rounds = (9, 6, 3) if args.quick else (8, 12, 3)
    set_blocks = prefixes * prefix_blocks
    device = max(set_blocks // 3, 2 * (prefix_blocks + 2))
    prompts = tier_stack.stack_trace(prefixes, prefix_blocks, rounds, PRESETS[model].vocab_size)
    plan = tier_stack.stack_configs(device, set_blocks)
    tier_stack.serve_stack(model, prompts[:4], device, 0, 0, 0, 4, run_waves)  # first forwards: not timed
    runs: dict[str, list[dict]] = {k: [] for k in plan}
    for _ in range(args.repeats):
        for k, (host, node_host, disk) in plan.items():
            runs[k].append(tier_stack.serve_stack(model, prompts, device, host, node_host, disk, 4, run_waves))
    want = runs["device only"][0]["outputs"]
    identical = {k: all(r.pop("outputs") == want for r in rs) for k, rs in runs.items()}
    median = {k: sorted(rs, key=lambda r: r["tokens_per_cpu_s"])[len(rs) // 2] for k, rs in runs.items()}
    if args.json:
        print(json.dumps({"stack": median, "identical": identical}, indent=2))
        return
    h, nh, d = plan["+ disk"]
    tier_stack.report_stack(f"the stack, model {model}: {prefixes} prefixes x {prefix_blocks} blocks ({set_blocks} "
                            f"blocks, {set_blocks / device:.1f}x the device pool of {device}) in {rounds} rounds of "
                            f"random order; private host {h}, node host {nh}, disk {d} blocks; hit rate by level "
                            f"(dev, host: the private tier; n-host, n-disk: the node tier's); load average "
                            f"{os.getloadavg()[0]:.1f}", median, identical)


def policies(args: argparse.Namespace) -> None:
    model = "tiny" if args.quick else "small"
    prefixes, prefix_blocks, rounds = (9, 6, 2) if args.quick else (8, 12, 3)
    set_blocks = prefixes * prefix_blocks
    device_blocks = max(set_blocks // 3, 2 * (prefix_blocks + 2))  # ~1/3 of the set, >= a wave
    prompts = trace(prefixes, prefix_blocks, rounds, PRESETS[model].vocab_size)
    torch.manual_seed(0)
    plan = configs(device_blocks, set_blocks)
    serve(model, prompts[:4], device_blocks, 0, "demote", 4)  # the process's first forwards are slower: not timed
    runs: dict[str, list[dict]] = {k: [] for k in plan}
    for _ in range(args.repeats):  # interleaved, the median of each: a shared machine's noise
        for k, (host_blocks, policy) in plan.items():
            runs[k].append(serve(model, prompts, device_blocks, host_blocks, policy, 4))
    want = runs["device only"][0]["outputs"]
    identical = {k: all(r.pop("outputs") == want for r in rs) for k, rs in runs.items()}  # every run
    median = {k: sorted(rs, key=lambda r: r["tokens_per_cpu_s"])[len(rs) // 2] for k, rs in runs.items()}
    header = (f"model {model}, {prefixes} prefixes x {prefix_blocks} blocks of {BLOCK} ({set_blocks} blocks, "
              f"{set_blocks / device_blocks:.1f}x the device tier of {device_blocks}), {rounds} rounds; host tier "
              f"{plan['demote'][0]} blocks, small {plan['demote, small host'][0]}; per step (st): blocks and KiB "
              "copied, ms copying (wall) and its share of CPU time, host blocks duplicating device ones (dup); "
              "x: ratio against device only")
    report(model, header, median, identical, args.json)


if __name__ == "__main__":
    main()
