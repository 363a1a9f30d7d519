"""Pieces shared by both attention kernels: the online-softmax tile step and argument checks.

Scores live in the log2 domain (scaled by log2(e)) so the update uses exp2. A tile is TILE_N
consecutive positions of one sequence; each position looks up its own physical block in the
block table, so TILE_N is independent of the cache block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # tanh via sigmoid: stable at both ends (exp overflow gives exactly +-1).
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_P2] query rows, cache dtype
    acc,  # [BLOCK_M, HEAD_P2] fp32 unnormalised output
    m_i,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i,  # [BLOCK_M] fp32 running sum of exp2
    q_pos,  # [BLOCK_M] absolute position of each query row
    start,  # first position of this tile
    hi,  # one past the last position any row may see
    k_base,  # cache pointer at K, this kv head
    v_base,  # cache pointer at V, this kv head
    bt_row,  # block-table row of this sequence
    stride_c_blk,
    stride_c_off,
    scale,
    softcap,
    window,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size: divisions become shifts
    HEAD_SIZE: tl.constexpr,
    HEAD_P2: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = start + tl.arange(0, TILE_N)
    n_mask = n < hi
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD_SIZE
    blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_off = blk * stride_c_blk + (n % BLOCK_SIZE) * stride_c_off  # [TILE_N]
    k = tl.load(  # [HEAD_P2, TILE_N]
        k_base + kv_off[None, :] + d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
    )
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
    if USE_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = s * LOG2E
    allowed = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
    if USE_WINDOW:
        allowed = allowed & (n[None, :] > q_pos[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(  # [TILE_N, HEAD_P2]
        v_base + kv_off[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def dot_dim(n: int) -> int:
    """A block dimension holding n: a power of two, and at least 16 as tl.dot requires."""
    return max(16, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches get exact fp32 dots (tf32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    tile_n: int,
) -> None:
    """Assert the shapes, dtypes, strides and devices both attention launch wrappers rely on."""
    assert tile_n >= 16 and tile_n & (tile_n - 1) == 0, f"tile_n {tile_n} must be 2**k >= 16"
    assert query.dim() == 3, f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}"
    num_heads, head_size = query.shape[1:]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], "
        f"got {tuple(kv_cache.shape)}"
    )
    num_kv_heads = kv_cache.shape[3]
    assert kv_cache.shape[4] == head_size, (
        f"kv_cache head_size {kv_cache.shape[4]} != query head_size {head_size}"
    )
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
    )
    assert query.dtype == kv_cache.dtype, f"query {query.dtype} and kv_cache {kv_cache.dtype} differ"
    assert out.shape == query.shape and out.dtype == query.dtype, (
        f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}"
    )
    num_seqs = seq_lens.shape[0]
    for name, t, shape in (
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("seq_lens", seq_lens, (num_seqs,)),
        ("block_table", block_table, (num_seqs, block_table.shape[-1])),
    ):
        assert t.dtype == torch.int32 and tuple(t.shape) == shape, (
            f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}"
        )
        assert t.device == query.device, f"{name} is on {t.device}, query on {query.device}"
    assert kv_cache.device == query.device, f"kv_cache on {kv_cache.device}, query on {query.device}"
    assert query.stride(2) == out.stride(2) == kv_cache.stride(4) == 1, (
        "the head_size dimension of query, out and kv_cache must be contiguous"
    )
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous(), (
        "query_start_loc and seq_lens must be contiguous"
    )

