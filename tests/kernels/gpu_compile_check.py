"""Compile every kernel for a real GPU target (sm_90 cubin) on a machine without one.

The interpreter never runs Triton's GPU compiler, so type errors in loops, tl.dot shape limits
and layout failures only show on a GPU. This script runs ttir -> ttgir -> llir -> ptx -> cubin
(ptxas ships with triton) for representative specialisations. It must run without
TRITON_INTERPRET (kernels must be JITFunctions): test_kernel_compile.py starts it as a
subprocess. Prints one line per variant; exits 1 if any fails.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvpool.kernels.copy_blocks_triton import _copy_blocks_kernel  # noqa: E402
from kvpool.kernels.decode_split_kv import _decode_split_kv_kernel, _merge_splits_kernel  # noqa: E402
from kvpool.kernels.paged_attention_triton import _paged_attention_kernel  # noqa: E402
from kvpool.kernels.reshape_and_cache_triton import _reshape_and_cache_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
I32 = "i32"


def _compile(kernel, runtime: dict[str, str], const: dict) -> None:
    sig = {**runtime, **{name: "constexpr" for name in const}}
    assert set(sig) == set(kernel.arg_names), set(sig) ^ set(kernel.arg_names)
    sig = {name: sig[name] for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, sig, const), target=TARGET)


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


def variants():
    for dt, prec in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")):
        yield f"paged_attention {dt} gqa4 head80 window softcap", _paged_attention_kernel, _attention_sig(dt, False), dict(
            QPK=4, BLOCK_Q=4, BLOCK_M=16, TILE_N=32, BLOCK_SIZE=16, HEAD_SIZE=80, HEAD_P2=128,
            USE_SOFTCAP=True, USE_WINDOW=True, DOT_PRECISION=prec,
        )
    yield "paged_attention bf16 mha head128 prefill", _paged_attention_kernel, _attention_sig("bf16", False), dict(
        QPK=1, BLOCK_Q=64, BLOCK_M=64, TILE_N=32, BLOCK_SIZE=32, HEAD_SIZE=128, HEAD_P2=128,
        USE_SOFTCAP=False, USE_WINDOW=False, DOT_PRECISION="tf32",
    )
    yield "decode_split_kv bf16 gqa4 head128", _decode_split_kv_kernel, _attention_sig("bf16", True), dict(
        QPK=4, BLOCK_H=16, TILE_N=32, BLOCK_SIZE=16, HEAD_SIZE=128, HEAD_P2=128,
        USE_SOFTCAP=True, USE_WINDOW=True, DOT_PRECISION="tf32",
    )
    yield "merge_splits bf16", _merge_splits_kernel, dict(
        part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", stride_o_tok=I32, stride_o_head=I32,
        num_splits=I32,
    ), dict(SPLITS_P2=64, HEAD_SIZE=96, HEAD_P2=128)
    cache_strides = {n: I32 for n in ("stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head")}
    cache_strides.update(stride_c_kv="i64", stride_c_blk=I32, stride_c_off=I32, stride_c_head=I32, block_size=I32)
    yield "reshape_and_cache bf16 head80", _reshape_and_cache_kernel, dict(
        key_ptr="*bf16", value_ptr="*bf16", cache_ptr="*bf16", slot_ptr="*i64", **cache_strides
    ), dict(NUM_KV_HEADS=3, HEAD_SIZE=80, HEADS_P2=4, HEAD_P2=128)
    yield "copy_blocks bf16", _copy_blocks_kernel, dict(
        layer_ptrs="*i64", mapping_ptr="*i64", stride_kv="i64", stride_blk=I32
    ), dict(BLOCK_NUMEL=16 * 8 * 128, CHUNK=4096, ELEM=triton.language.bfloat16)


def main() -> int:
    failed = 0
    for name, kernel, runtime, const in variants():
        try:
            _compile(kernel, runtime, const)
            print(f"ok   {name}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
