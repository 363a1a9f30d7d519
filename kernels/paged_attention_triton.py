"""Paged attention for a mixed prefill + decode batch, one kernel for both.

A program owns (a block of BLOCK_Q query tokens of one sequence, one kv head) and computes every
query head of that kv head's group: its BLOCK_M = BLOCK_Q * queries_per_kv rows share each K/V
tile it loads (GQA). It walks the sequence's paged K/V with an online softmax, stopping at the
causal edge of its last query token and starting at the sliding-window edge of its first.

Query blocks never straddle sequences. Sequence s's blocks are numbered from
query_start_loc[s] // BLOCK_Q + s, which is monotonic in s and leaves room for its partial
block, so num_tokens // BLOCK_Q + num_seqs programs cover every batch without a host sync; a
program finds its sequence by binary search and exits if it falls in a gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import _attend_tile, begin_launch, launch_args
from .metadata import AttentionMetadata


@triton.jit
def _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    # Largest s with query_start_loc[s] // BLOCK_Q + s <= q_block.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    out_ptr,  # [num_tokens, num_heads, head_size]
    qsl_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    bt_ptr,  # [num_seqs, max_blocks] int32
    scale,
    softcap,
    window,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_bt,
    QPK: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * QPK, a power of two
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_P2: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query index in this block
    if first >= q_len:
        return
    context = tl.load(seq_lens_ptr + seq) - q_len  # tokens before this query

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_mask = (rows < BLOCK_Q * QPK) & (tok < q_len)
    d = tl.arange(0, HEAD_P2)
    qd_mask = row_mask[:, None] & (d[None, :] < HEAD_SIZE)
    q_off = (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)  # [BLOCK_M, HEAD_P2]
    q_pos = context + tok

    hi = context + tl.minimum(first + BLOCK_Q, q_len)  # causal edge of the block's last token
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, context + first - window + 1)
    k_base = cache_ptr + kv_head * stride_c_head
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    for start in range(lo // TILE_N * TILE_N, hi, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, start, hi, k_base, k_base + stride_c_kv, bt_row,
            stride_c_blk, stride_c_off, scale, softcap, window,
            TILE_N, BLOCK_SIZE, HEAD_SIZE, HEAD_P2, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION,
        )
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=qd_mask)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    out: torch.Tensor | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context; see module doc."""
    out = begin_launch(_paged_attention_kernel, query, kv_cache, meta, out)
    num_tokens = query.shape[0]
    num_seqs, num_kv_heads = meta.num_seqs, kv_cache.shape[3]
    if num_tokens == 0 or num_seqs == 0:
        return out
    args = launch_args(query, kv_cache, meta, num_tokens / num_seqs, tile_n)
    block_q = args.tiles.block_m // args.qpk
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    bt = meta.block_tables
    _paged_attention_kernel[grid](
        query, kv_cache, out, meta.query_start_loc, meta.seq_lens, bt,
        *args.scalars, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *args.cache_strides, bt.stride(0),
        BLOCK_Q=block_q, BLOCK_M=args.tiles.block_m, **args.constexprs,
    )
    return out
