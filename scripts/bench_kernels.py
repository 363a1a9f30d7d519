#!/usr/bin/env python3
"""Paged-attention kernel benchmark: decode bandwidth and prefill throughput on a GPU.

Decode runs Llama-3-8B attention (32 query / 8 kv heads, head 128, bf16, block 16, shuffled
block tables) at batch {1, 16, 64} x context {512, 4096, 32768}. Bandwidth = bytes of K/V read /
time, also as a fraction of the device peak. The baseline, measured in the same run, is torch's
scaled_dot_product_attention over a contiguous [batch, heads, ctx, head] cache (enable_gqa, so
it reads the same bytes). Each call is timed alone with CUDA events after flushing L2; the median
is reported. Prefill reports tokens/s for one prompt of each length against causal SDPA.

    python scripts/bench_kernels.py                  # the tables (needs CUDA)
    python scripts/bench_kernels.py --check          # bf16 correctness vs the torch reference
    python scripts/bench_kernels.py --cpu-smoke      # tiny fp16 run under the Triton interpreter
    python scripts/bench_kernels.py --json out.json  # also write the rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

# GB/s by device-name substring, most specific first (torch reports e.g. "NVIDIA H100 80GB HBM3").
PEAK_GBPS = [
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350),
    ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
    ("L40S", 864), ("L4", 300), ("A10", 600), ("RTX 4090", 1008),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="bf16 correctness vs the reference")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes under the interpreter")
    p.add_argument("--peak-gbps", type=float, help="device peak bandwidth (default: by name)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", metavar="PATH", help="write all measured rows as JSON")
    return p.parse_args()


def make_inputs(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    """(query, kv_cache, metadata) with one random permutation of block ids; block 0 is null."""
    import torch

    from kvpool.kernels import AttentionMetadata

    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 1
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    query = torch.randn(sum(q_lens), num_heads, head_size, dtype=dtype, device=device)
    meta = AttentionMetadata.from_lengths(q_lens, seq_lens, tables, head_size**-0.5, device=device)
    return query, cache, meta


def time_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median milliseconds of one call: CUDA events around each call, L2 flushed before it."""
    import torch

    if not torch.cuda.is_available():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_fn(batch, ctx, q_len, cfg, causal) -> tuple[Callable[[], object], str]:
    """Torch SDPA over a contiguous [batch, heads, ctx, head] cache: the baseline.

    Fused backends only where one takes these shapes (else the math backend, named in the row,
    would make the ratio flatter than a fair baseline).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def r(h, n):
        return torch.randn(batch, h, n, cfg["head"], dtype=cfg["dtype"], device=cfg["device"])

    q, k, v = r(cfg["heads"], q_len), r(cfg["kv_heads"], ctx), r(cfg["kv_heads"], ctx)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    for backends, name in ((fused, "fused"), ([SDPBackend.MATH], "math")):
        def call(backends=backends):
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        try:
            call()
            return call, name
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend takes these shapes")


def bench_decode(cfg, batch, ctx, peak, args) -> dict:
    from kvpool.kernels import paged_attention
    from kvpool.kernels.dispatch import decode_splits

    inputs = make_inputs(
        [1] * batch, [ctx] * batch, cfg["heads"], cfg["kv_heads"], cfg["head"], cfg["block"],
        cfg["dtype"], cfg["device"],
    )
    out = inputs[0].clone()
    ms = time_ms(lambda: paged_attention(*inputs, out=out), args.warmup, args.repeats)
    base, backend = sdpa_fn(batch, ctx, 1, cfg, False)
    base_ms = time_ms(base, args.warmup, args.repeats)
    gbytes = 2 * batch * ctx * cfg["kv_heads"] * cfg["head"] * inputs[1].element_size() / 1e9
    splits = decode_splits(*inputs)
    return dict(
        batch=batch, ctx=ctx, splits=splits, ms=ms, gbps=gbytes / ms * 1e3,
        peak_frac=gbytes / ms * 1e3 / peak if peak else None,
        sdpa_ms=base_ms, sdpa_gbps=gbytes / base_ms * 1e3, sdpa=backend, speedup=base_ms / ms,
    )


def bench_prefill(cfg, length, args) -> dict:
    from kvpool.kernels import paged_attention

    inputs = make_inputs(
        [length], [length], cfg["heads"], cfg["kv_heads"], cfg["head"], cfg["block"],
        cfg["dtype"], cfg["device"],
    )
    out = inputs[0].clone()
    ms = time_ms(lambda: paged_attention(*inputs, out=out), args.warmup, args.repeats)
    base, backend = sdpa_fn(1, length, length, cfg, True)
    base_ms = time_ms(base, args.warmup, args.repeats)
    return dict(
        prompt=length, ms=ms, tokens_per_s=length / ms * 1e3, sdpa_ms=base_ms,
        sdpa_tokens_per_s=length / base_ms * 1e3, sdpa=backend, speedup=base_ms / ms,
    )


def run_check(cfg, long_ctx: int) -> bool:
    """Kernel vs reference over mixed, split-KV decode, window and softcap batches."""
    from dataclasses import replace

    import torch

    from kvpool.kernels import paged_attention, set_backend

    cases = [
        ("mixed", [1, 17, 5, 1, 30], [1, 17, 129, 300, 333], {}),
        ("decode-split", [1, 1], [long_ctx // 7, long_ctx], {}),
        ("window+softcap", [64, 1, 1], [200, long_ctx, 17], dict(sliding_window=128, softcap=30.0)),
    ]
    tol = 3e-2 if cfg["dtype"] == torch.bfloat16 else 4e-3
    ok = True
    for name, q_lens, seq_lens, kwargs in cases:
        query, cache, meta = make_inputs(
            q_lens, seq_lens, cfg["heads"], cfg["kv_heads"], cfg["head"], cfg["block"],
            cfg["dtype"], cfg["device"],
        )
        meta = replace(meta, **kwargs)
        set_backend("triton")
        got = paged_attention(query, cache, meta).float()
        set_backend("torch")
        want = paged_attention(query, cache, meta).float()
        err = (got - want).abs().max().item()
        good = torch.allclose(got, want, atol=tol, rtol=tol)
        ok &= good
        print(f"{name:16s} {cfg['dtype']}  max abs err {err:.2e}  {'ok' if good else 'FAIL'}")
    set_backend("auto")
    return ok


def print_rows(title: str, rows: list[dict]) -> None:
    widths = [max(10, len(k)) for k in rows[0]]
    print(f"\n{title}")
    print("  ".join(f"{k:>{w}s}" for k, w in zip(rows[0], widths, strict=True)))
    for row in rows:
        cells = [
            f"{v:{w}.4g}" if isinstance(v, float) else f"{v!s:>{w}s}"
            for v, w in zip(row.values(), widths, strict=True)
        ]
        print("  ".join(cells))


def setup(args: argparse.Namespace) -> tuple[dict, dict]:
    """Config for this run; the CPU smoke run swaps in tiny fp16 shapes (no bf16 on CPU)."""
    if args.cpu_smoke:
        # Before anything imports triton: the interpreter runs the kernels on CPU tensors.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kvpool.kernels import set_backend

    if args.cpu_smoke:
        set_backend("triton")
        args.warmup, args.repeats = 1, 2
        cfg = dict(heads=4, kv_heads=1, head=64, block=16, dtype=torch.float16, device="cpu")
        return cfg, dict(batches=[1, 2], contexts=[64, 256], prompts=[32], check_ctx=1100)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: no CUDA device. It measures GPU kernels; --cpu-smoke runs tiny "
                 "shapes under the Triton interpreter instead.")
    cfg = dict(heads=32, kv_heads=8, head=128, block=16, dtype=torch.bfloat16, device="cuda")
    sizes = dict(batches=[1, 16, 64], contexts=[512, 4096, 32768], prompts=[512, 2048, 8192])
    return cfg, {**sizes, "check_ctx": 30000}


def peak_gbps(args: argparse.Namespace) -> float | None:
    import torch

    if args.peak_gbps or not torch.cuda.is_available():
        return args.peak_gbps
    name = torch.cuda.get_device_name()
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def main() -> None:
    args = parse_args()
    cfg, sizes = setup(args)
    if args.check:
        sys.exit(0 if run_check(cfg, sizes["check_ctx"]) else 1)
    peak = peak_gbps(args)
    print(f"device peak: {peak or 'unknown (pass --peak-gbps)'} GB/s; {cfg}")
    if args.cpu_smoke:
        print("cpu smoke run: interpreter timings say nothing about GPU speed")
    decode = []
    for batch in sizes["batches"]:
        for ctx in sizes["contexts"]:
            decode.append(bench_decode(cfg, batch, ctx, peak, args))
            print(f"  decode batch {batch} ctx {ctx}: {decode[-1]['ms']:.3f} ms", flush=True)
    prefill = [bench_prefill(cfg, n, args) for n in sizes["prompts"]]
    print_rows("decode (speedup = sdpa_ms / ms)", decode)
    print_rows("prefill, batch 1 (speedup = sdpa_ms / ms)", prefill)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config={k: str(v) for k, v in cfg.items()}, decode=decode, prefill=prefill), f, indent=1)


if __name__ == "__main__":
    main()
