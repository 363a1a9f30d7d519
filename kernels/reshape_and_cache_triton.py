"""Write new tokens' K/V into their paged-cache slots (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_cache_write


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_ptr,  # [num_tokens] int64
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_P2: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, HEAD_P2)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
    k = tl.load(key_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_off + h * stride_c_head + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value rows into kv_cache at slot_mapping (in place; slot -1 = skip)."""
    check_cache_write(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_P2=triton.next_power_of_2(head_size),
    )
