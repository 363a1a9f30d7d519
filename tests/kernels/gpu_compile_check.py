"""Compile every kernel for a real GPU target (sm_90 cubin) on a machine without one.

The interpreter never runs Triton's GPU compiler, so type errors in loops, tl.dot shape limits
and layout failures only show on a GPU. This script runs ttir -> ttgir -> llir -> ptx -> cubin
(ptxas ships with triton) for the tile shapes the launch wrappers choose (choose_tiles) at head
sizes 80 to 512, and reads each cubin's resource use with cuobjdump (shipped beside ptxas):
registers per thread, stack frame (local memory, i.e. register spills) and shared memory. A
variant that fails to compile, or an attention variant with a stack frame, fails the run, except
a shape chosen by timing on a GPU (choose_tiles says which), whose spills were measured to cost
less than a narrower tile. It
must run without TRITON_INTERPRET (kernels must be JITFunctions): test_kernel_compile.py starts
it as a subprocess.

    python tests/kernels/gpu_compile_check.py          # one line per variant; exit 1 on failure
    python tests/kernels/gpu_compile_check.py --sweep  # every prefill tile shape, head 128-512
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvpool.kernels.attention_common import choose_tiles, dot_dim  # noqa: E402
from kvpool.kernels.copy_blocks_triton import _copy_blocks_kernel  # noqa: E402
from kvpool.kernels.decode_split_kv import _decode_split_kv_kernel, _merge_splits_kernel  # noqa: E402
from kvpool.kernels.paged_attention_triton import _paged_attention_kernel  # noqa: E402
from kvpool.kernels.reshape_and_cache_triton import _reshape_and_cache_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
I32 = "i32"


def _compile(kernel, runtime: dict[str, str], const: dict, options: dict):
    sig = {**runtime, **{name: "constexpr" for name in const}}
    if set(sig) != set(kernel.arg_names):
        raise ValueError(f"signature mismatch: {set(sig) ^ set(kernel.arg_names)}")
    sig = {name: sig[name] for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, const), target=TARGET, options=options)


def _attention_sig(dt: str, split: bool) -> dict[str, str]:
    sig = {"q_ptr": f"*{dt}", "cache_ptr": f"*{dt}"}
    if split:
        sig.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", chunk=I32)
    else:
        sig.update(out_ptr=f"*{dt}", qsl_ptr="*i32", num_seqs=I32, stride_o_tok=I32, stride_o_head=I32)
    sig.update(seq_lens_ptr="*i32", bt_ptr="*i32", scale="fp32", softcap="fp32")
    for name in ("window", "stride_q_tok", "stride_q_head", "stride_c_blk",
                 "stride_c_off", "stride_c_head", "stride_bt"):
        sig[name] = I32
    sig["stride_c_kv"] = "i64"  # a large cache's K/V stride passes 2**31
    return sig


def _attention(dt: str, head: int, qpk: int, avg_rows: float, split: bool = False):
    """Constexprs and warps the launch wrappers use (window and softcap on: the most registers)."""
    tiles = choose_tiles(head, avg_rows, qpk, 4 if dt == "fp32" else 2)
    rows = dict(BLOCK_H=tiles.block_m) if split else dict(BLOCK_Q=tiles.block_m // qpk, BLOCK_M=tiles.block_m)
    const = dict(QPK=qpk, **rows, TILE_N=tiles.tile_n, BLOCK_SIZE=16, HEAD_SIZE=head,
                 HEAD_P2=dot_dim(head), USE_SOFTCAP=True, USE_WINDOW=True,
                 DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
    name = f"rows{tiles.block_m} tile{tiles.tile_n} warps{tiles.num_warps}"
    options = dict(num_warps=tiles.num_warps)
    if tiles.num_stages is not None:
        name += f" stages{tiles.num_stages}"
        options.update(num_stages=tiles.num_stages)
    return name, _attention_sig(dt, split), const, options


def variants():
    """(name, kernel, runtime signature, constexprs, compile options, must not spill)."""
    kernel = _paged_attention_kernel
    for dt in ("bf16", "fp32"):
        for head in (80, 128, 256, 512):
            tiles, sig, const, options = _attention(dt, head, 4, 64)
            # the 16-bit prefill tile at head <= 128 was timed on an H200 (choose_tiles): 4 warps may
            # spill a few bytes with softcap and window on and still ran 1.4-2x faster than 8
            timed = "num_stages" in options
            yield f"paged_attention {dt} gqa4 head{head} prefill {tiles}", kernel, sig, const, options, not timed
        for head in (128, 256, 512):
            tiles, sig, const, options = _attention(dt, head, 4, 1)
            yield f"paged_attention {dt} gqa4 head{head} decode {tiles}", kernel, sig, const, options, True
            tiles, sig, const, options = _attention(dt, head, 4, 1, split=True)
            yield f"decode_split_kv {dt} gqa4 head{head} {tiles}", _decode_split_kv_kernel, sig, const, options, True
    yield "merge_splits bf16", _merge_splits_kernel, dict(
        part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", stride_o_tok=I32, stride_o_head=I32,
        num_splits=I32,
    ), dict(SPLITS_P2=64, HEAD_SIZE=96, HEAD_P2=128), dict(num_warps=4), False
    cache_strides = {n: I32 for n in ("stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head")}
    cache_strides.update(stride_c_kv="i64", stride_c_blk=I32, stride_c_off=I32, stride_c_head=I32, block_size=I32)
    yield "reshape_and_cache bf16 head80", _reshape_and_cache_kernel, dict(
        key_ptr="*bf16", value_ptr="*bf16", cache_ptr="*bf16", slot_ptr="*i64", **cache_strides
    ), dict(NUM_KV_HEADS=3, HEAD_SIZE=80, HEADS_P2=4, HEAD_P2=128), dict(num_warps=4), False
    yield "copy_blocks bf16", _copy_blocks_kernel, dict(
        layer_ptrs="*i64", mapping_ptr="*i64", stride_kv="i64", stride_blk=I32
    ), dict(BLOCK_NUMEL=16 * 8 * 128, CHUNK=4096, ELEM=triton.language.bfloat16), dict(num_warps=4), False


def sweep():
    """Every prefill tile shape at the large head sizes, chosen or not (to revisit choose_tiles)."""
    for dt in ("bf16", "fp32"):
        for head in (128, 256, 512):
            for rows in (64, 32, 16):
                for tile_n in (32, 16):
                    for warps in (4, 8):
                        _, sig, const, _ = _attention(dt, head, 1, 64)
                        const.update(BLOCK_Q=rows, BLOCK_M=rows, TILE_N=tile_n)
                        name = f"paged_attention {dt} head{head} rows{rows} tile{tile_n} warps{warps}"
                        yield name, _paged_attention_kernel, sig, const, dict(num_warps=warps), False


def resource_use(compiled) -> tuple[str, int]:
    """("registers R  stack S  shared M", S) of a compiled kernel; S bytes of stack are spills."""
    tool = Path(get_ptxas(TARGET.arch).path).with_name("cuobjdump")
    shared = f"shared {compiled.metadata.shared:>6}"
    if not tool.exists():
        return f"registers ?  stack ?  {shared} (no cuobjdump beside ptxas)", 0
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "kernel.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        res = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    usage = dict(re.findall(r"(REG|STACK):(\d+)", res.stdout))
    return f"registers {usage['REG']:>3}  stack {usage['STACK']:>5}  {shared}", int(usage["STACK"])


def main() -> int:
    chosen = sweep() if "--sweep" in sys.argv[1:] else variants()
    failed = 0
    for name, kernel, runtime, const, options, no_spill in chosen:
        try:
            usage, stack = resource_use(_compile(kernel, runtime, const, options))
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
            continue
        spills = no_spill and stack > 0
        failed += spills
        print(f"{'SPILL' if spills else 'ok  '} {name:55s} {usage}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
