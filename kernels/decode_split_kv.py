"""Flash-decoding: split-KV decode for long contexts at small batch.

With q_len 1 and few (sequence, kv head) pairs, one program per pair leaves most SMs idle while
each walks a long context. Here each pair's context is cut into num_splits chunks, one program
each (all query heads of the kv head group together, GQA); each writes its normalised partial
output and log2-sum-exp. A second small kernel merges the splits per (token, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import _attend_tile, begin_launch, launch_args
from .metadata import AttentionInputError, AttentionMetadata


@triton.jit
def _decode_split_kv_kernel(
    q_ptr,  # [num_seqs, num_heads, head_size]: token i is sequence i's only new token
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    part_out_ptr,  # [num_seqs, num_heads, num_splits, HEAD_P2] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain
    seq_lens_ptr,  # [num_seqs] int32
    bt_ptr,  # [num_seqs, max_blocks] int32
    scale,
    softcap,
    window,
    chunk,  # positions per split, a multiple of TILE_N
    stride_q_tok,
    stride_q_head,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_bt,
    QPK: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= QPK, a power of two, >= 16 for tl.dot
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_P2: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * QPK + rows
    d = tl.arange(0, HEAD_P2)
    qd_mask = (rows[:, None] < QPK) & (d[None, :] < HEAD_SIZE)
    q = tl.load(
        q_ptr + seq * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=qd_mask, other=0.0,
    )
    lo = split * chunk
    if USE_WINDOW:
        lo = tl.maximum(lo, (q_pos - window + 1) // TILE_N * TILE_N)
    hi = tl.minimum(split * chunk + chunk, seq_len)
    k_base = cache_ptr + kv_head * stride_c_head
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_P2], tl.float32)
    for start in range(lo, hi, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tl.full([BLOCK_H], q_pos, tl.int32), start, hi,
            k_base, k_base + stride_c_kv, bt_row, stride_c_blk, stride_c_off,
            scale, softcap, window,
            TILE_N, BLOCK_SIZE, HEAD_SIZE, HEAD_P2, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION,
        )
    # An empty split (past seq_len or before the window) reports lse = -inf and weighs nothing.
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    part = (seq * (QPK * tl.num_programs(1)) + head) * tl.num_programs(2) + split  # [BLOCK_H]
    tl.store(part_lse_ptr + part, lse, mask=rows < QPK)
    tl.store(part_out_ptr + part[:, None] * HEAD_P2 + d[None, :], acc, mask=qd_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, HEAD_P2] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32
    out_ptr,  # [num_seqs, num_heads, head_size]
    stride_o_tok,
    stride_o_head,
    num_splits,
    SPLITS_P2: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_P2: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_P2)
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, axis=0))  # the split holding q_pos is never empty
    parts = tl.load(
        part_out_ptr + (row * num_splits + s)[:, None] * HEAD_P2 + d[None, :],
        mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_SIZE), other=0.0,
    )
    o = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + seq * stride_o_tok + head * stride_o_head + d,
        o.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE,
    )


def decode_split_kv(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_splits: int,
    *,
    out: torch.Tensor | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Decode-only paged attention with each context split num_splits ways.

    Every sequence must have exactly one new token (``meta.is_decode_only``: decided from
    max_query_len, a host value, so no device sync). Splits cover meta.max_seq_len positions;
    splits beyond a sequence's length exit at once.
    """
    out = begin_launch(_decode_split_kv_kernel, query, kv_cache, meta, out)
    num_seqs, num_heads, head_size = query.shape
    if not meta.is_decode_only(num_seqs):
        raise AttentionInputError(
            f"split-KV decode needs one query token per sequence: {num_seqs} tokens, "
            f"{meta.num_seqs} sequences, max_query_len {meta.max_query_len}"
        )
    if num_splits < 1:
        raise AttentionInputError(f"num_splits must be >= 1, got {num_splits}")
    if num_seqs == 0:
        return out
    args = launch_args(query, kv_cache, meta, 1, tile_n)
    tile = args.tiles.tile_n
    chunk = triton.cdiv(triton.cdiv(max(meta.max_seq_len, 1), num_splits), tile) * tile
    head_p2 = args.head_p2
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, head_p2, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    bt = meta.block_tables
    _decode_split_kv_kernel[(num_seqs, kv_cache.shape[3], num_splits)](
        query, kv_cache, part_out, part_lse, meta.seq_lens, bt,
        *args.scalars, chunk,
        query.stride(0), query.stride(1),
        *args.cache_strides, bt.stride(0),
        BLOCK_H=args.tiles.block_m, **args.constexprs,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
        SPLITS_P2=triton.next_power_of_2(num_splits),
        HEAD_SIZE=head_size, HEAD_P2=head_p2,
    )
    return out
