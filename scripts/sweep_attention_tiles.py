#!/usr/bin/env python3
"""The prefill attention kernel's launch shape, swept on a GPU: which tiles are fastest.

``choose_tiles`` (kvpool/kernels/attention_common.py) picks the rows per program (BLOCK_M), the
K/V positions per online-softmax step (TILE_N) and the warps from register budgets read off the
compiler; this measures them. For each prompt length of bench_kernels.py's prefill table
(Llama-3-8B attention, bf16, block 16, one prompt) it times every (BLOCK_M, TILE_N, warps,
stages) variant of the mixed prefill kernel (kernels/paged_attention_triton.py), checks each
variant's output against the torch path on the same inputs, and prints the variants sorted by
time beside the shape ``choose_tiles`` picks today and causal SDPA on contiguous K/V (the same
baseline bench_kernels.py prints). A variant the compiler refuses (shared memory, registers) is
listed as such.

    python scripts/sweep_attention_tiles.py               # needs CUDA; about 2 minutes on an H200
    python scripts/sweep_attention_tiles.py --prompts 2048 --top 5
    python scripts/sweep_attention_tiles.py --cpu-smoke   # tiny fp16, Triton interpreter: the script runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys

import bench_kernels


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="512,2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--block-m", default="32,64,128")
    p.add_argument("--tile-n", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--top", type=int, default=8, help="variants printed per prompt length")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny fp16 shapes under the Triton interpreter")
    return p.parse_args()


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    args = parse_args()
    if args.cpu_smoke:  # before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        sys.exit("sweep_attention_tiles: needs a CUDA device (it times GPU kernels); --cpu-smoke runs tiny shapes")
    from kvpool.kernels import attention_common as common
    from kvpool.kernels import paged_attention as dispatched
    from kvpool.kernels import paged_attention_triton as kernel
    from kvpool.kernels import set_backend

    cfg = dict(heads=32, kv_heads=8, head=128, block=16, dtype=torch.bfloat16, device="cuda")
    if args.cpu_smoke:
        cfg = dict(heads=4, kv_heads=1, head=64, block=16, dtype=torch.float16, device="cpu")
        args.prompts, args.block_m, args.tile_n, args.warps, args.stages = "40", "16,32", "16,32", "4", "1"
        args.warmup, args.repeats = 0, 1
    qpk = cfg["heads"] // cfg["kv_heads"]
    original = kernel.launch_args

    def shaped(block_m: int, tile_n: int, warps: int, stages: int):
        def launch_args(query, kv_cache, meta, avg_rows, _tile_n):
            a = original(query, kv_cache, meta, avg_rows, tile_n)
            cx = dict(a.constexprs, TILE_N=tile_n, num_warps=warps, num_stages=stages)
            return dataclasses.replace(a, tiles=common.Tiles(block_m, tile_n, warps), constexprs=cx)
        return launch_args

    variants = [v for v in itertools.product(ints(args.block_m), ints(args.tile_n), ints(args.warps),
                                             ints(args.stages)) if v[0] >= qpk]
    device = torch.cuda.get_device_name() if cfg["device"] == "cuda" else "cpu (interpreter: timings mean nothing)"
    print(f"{device}; {cfg}; {len(variants)} variants")
    for length in ints(args.prompts):
        query, cache, meta = bench_kernels.make_inputs(
            [length], [length], cfg["heads"], cfg["kv_heads"], cfg["head"], cfg["block"], cfg["dtype"], cfg["device"])
        set_backend("torch")
        want = dispatched(query, cache, meta).float()
        set_backend("auto")
        today = common.choose_tiles(cfg["head"], length, qpk, query.element_size())
        out = query.clone()
        call = functools.partial(kernel.paged_attention, query, cache, meta, out=out)
        base, backend = bench_kernels.sdpa_fn(1, length, length, cfg, True)
        sdpa_ms = bench_kernels.time_ms(base, args.warmup, args.repeats)
        kernel.launch_args = original
        today_ms = bench_kernels.time_ms(call, args.warmup, args.repeats)
        rows, refused = [], []
        for v in variants:
            kernel.launch_args = shaped(*v)
            try:
                got = call().float()
                if query.is_cuda:
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (the compiler's refusal, reported)
                refused.append(f"{v}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
                continue
            err = (got - want).abs().max().item()
            ms = bench_kernels.time_ms(call, args.warmup, args.repeats)
            rows.append((ms, v, err))
        kernel.launch_args = original
        rows.sort()
        print(f"\nprompt {length}: sdpa ({backend}) {sdpa_ms:.4f} ms; today's tiles (block_m {today.block_m}, "
              f"tile_n {today.tile_n}, warps {today.num_warps}, default stages) {today_ms:.4f} ms = "
              f"{sdpa_ms / today_ms:.2f}x sdpa")
        print("     ms   x sdpa  x today  block_m tile_n warps stages  max abs err")
        for ms, (bm, tn, w, st), err in rows[:args.top]:
            print(f"{ms:7.4f}  {sdpa_ms / ms:6.2f}  {today_ms / ms:6.2f}  {bm:7d} {tn:6d} {w:5d} {st:6d}  {err:.2e}"
                  f"{'  WRONG' if err > 3e-2 else ''}")
        wrong = [v for _, v, err in rows if err > 3e-2]
        if wrong:
            print(f"  outputs off the torch path (> 3e-2): {wrong}")
        for line in refused:
            print(f"  refused {line}")


if __name__ == "__main__":
    main()
