"""Pieces shared by both attention kernels: the online-softmax tile step, the tile choice and
the launch prologue (input check, bf16 refusal, the arguments both kernels take alike).

Scores live in the log2 domain (scaled by log2(e)) so the update uses exp2. A tile is TILE_N
consecutive positions of one sequence; each position looks up its own physical block in the
block table, so TILE_N is independent of the cache block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .checks import check_attention
from .metadata import AttentionInputError, AttentionMetadata

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


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one attention program, chosen by head size (see choose_tiles)."""

    block_m: int  # query rows (tokens x heads of a kv group) per program
    tile_n: int  # K/V positions per online-softmax step
    num_warps: int
    num_stages: int | None = None  # software pipelining depth; None: Triton's default


def choose_tiles(
    head_size: int, avg_rows: float, qpk: int, elem_bytes: int, tile_n: int | None = None
) -> Tiles:
    """Rows and K/V tile by head size, so the fp32 accumulator and the tiles fit in registers.

    Compiled for sm_90 (tests/kernels/gpu_compile_check.py prints registers and stack per
    variant; --sweep every shape): a 64-row prefill tile spills 6-10 KB of stack at head 256 in
    fp32 and 0.1-0.4 KB in bf16, up to 26 KB at head 512; 64 rows need 8 warps even at head 128,
    and a 16-row fp32 program at head 128 spills with 32-position K/V tiles. So: prefill rows
    halve as the padded head doubles past 128; the K/V tile drops from 32 to 16 positions past
    head 128 and for 16-row fp32 programs; programs of 32 rows or more, or with a padded head
    of 256 or more, get 8 warps. Decode-heavy batches use 16 rows (the smallest tl.dot M); a program always holds at
    least one whole GQA group (qpk rows).

    Timed on an H200 (scripts/sweep_attention_tiles.py, Llama-3-8B attention, bf16, prompts of
    512, 2,048 and 8,192 tokens, two sweeps): a 16-bit prefill at head <= 128 ran 1.4-2x faster
    with 4 warps than with 8 at every length; 32- or 64-position K/V tiles and two or three
    pipeline stages were within the sweeps' noise of each other. 4 warps and 32 positions hold
    the fp32 accumulator in 255 registers (an 8-byte stack frame with softcap and window on).
    """
    head_p2 = dot_dim(head_size)
    prefill_rows = max(16, 64 * 128 // max(head_p2, 128))
    rows = prefill_rows if qpk * avg_rows >= 64 else 16
    block_m = max(rows, dot_dim(qpk))
    wide = elem_bytes == 2 and head_p2 <= 128 and block_m == 64  # the measured prefill shape
    if tile_n is None:
        tile_n = 16 if head_p2 > 128 or (elem_bytes == 4 and block_m == 16) else 32
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n {tile_n} must be a power of two >= 16")
    if wide:
        return Tiles(block_m, tile_n, 4, 2)
    return Tiles(block_m, tile_n, 8 if block_m >= 32 or head_p2 >= 256 else 4)


def refuse_interpreted_bf16(kernel: object, dtype: torch.dtype) -> None:
    """The Triton interpreter multiplies bf16 bit patterns (errors ~1e8): refuse, don't guess."""
    if dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction):
        raise AttentionInputError(
            "bf16 attention under the Triton interpreter (TRITON_INTERPRET=1) computes garbage: "
            "use fp16 or fp32 on CPU, the torch reference (set_backend('torch')), or a GPU"
        )


def begin_launch(
    kernel: object,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The output buffer, after the one input check and the interpreter's bf16 refusal.

    Both attention wrappers start here, so they refuse the same inputs in the same order.
    """
    out = torch.empty_like(query) if out is None else out
    check_attention(query, kv_cache, meta, out)
    refuse_interpreted_bf16(kernel, query.dtype)
    return out


@dataclass(frozen=True)
class LaunchArgs:
    """The kernel arguments both attention kernels derive alike from their inputs."""

    qpk: int  # query heads per kv head (GQA group size)
    tiles: Tiles
    head_p2: int  # head_size padded for tl.dot (dot_dim)
    scalars: tuple[float, float, int]  # scale, softcap, window; 0 means off (see the USE_ flags)
    cache_strides: tuple[int, int, int, int]  # kv, block, offset, head
    constexprs: dict[str, object]  # shared compile-time arguments and num_warps


def launch_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    avg_rows: float,
    tile_n: int | None,
) -> LaunchArgs:
    """Group size, tiles and the shared kernel arguments, for inputs begin_launch accepted."""
    _, num_heads, head_size = query.shape
    qpk = num_heads // kv_cache.shape[3]
    tiles = choose_tiles(head_size, avg_rows, qpk, query.element_size(), tile_n)
    head_p2 = dot_dim(head_size)
    constexprs: dict[str, object] = dict(
        QPK=qpk, TILE_N=tiles.tile_n, BLOCK_SIZE=kv_cache.shape[2],
        HEAD_SIZE=head_size, HEAD_P2=head_p2,
        USE_SOFTCAP=meta.softcap is not None, USE_WINDOW=meta.sliding_window is not None,
        DOT_PRECISION=dot_precision(query.dtype), num_warps=tiles.num_warps,
    )
    if tiles.num_stages is not None:
        constexprs["num_stages"] = tiles.num_stages
    return LaunchArgs(
        qpk=qpk,
        tiles=tiles,
        head_p2=head_p2,
        scalars=(meta.scale, meta.softcap or 0.0, meta.sliding_window or 0),
        cache_strides=(kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)),
        constexprs=constexprs,
    )
