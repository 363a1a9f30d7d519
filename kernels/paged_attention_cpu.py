"""Paged attention on the CPU through the C++ op of csrc/paged_attention_cpu.cpp: no gather.

The torch reference copies every context's K/V blocks into a padded tensor and then reads the
copy with SDPA; the op reads each row's blocks once, through the block table. Query tokens of
sequences with at most ``ROWS_MAX_QUERY`` new tokens (every decode, short chunks) go to the op as
rows, all in one call per layer; longer queries keep the reference's gather + SDPA, whose matrix
products beat a row-at-a-time kernel once one gather serves many queries. The op is built by
cpu_build.py; the dispatcher calls this only where it loaded.

Shapes as in reference.py: query/out [num_tokens, num_heads, head_size], kv_cache [2,
num_blocks, block_size, num_kv_heads, head_size].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from .checks import check_attention
from .metadata import AttentionMetadata

# Longest query (tokens of one sequence in one step) done row by row; longer ones gather once
# and use SDPA (scripts/bench_kernels.py --cpu measures the crossing).
ROWS_MAX_QUERY = 16


@dataclass(frozen=True)
class _RowPlan:
    """What every layer of a step shares: the op's rows, and the sequences left to SDPA."""

    token: torch.Tensor  # [rows] int64: the query token of each row
    seq: torch.Tensor  # [rows] int64: its sequence (block-table row)
    pos: torch.Tensor  # [rows] int64: its position; it sees positions <= pos
    long: list[int]  # sequences whose queries go through the reference's gather + SDPA


def _build_rows(meta: AttentionMetadata) -> _RowPlan:
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).to(torch.int64)
    short = q_lens <= ROWS_MAX_QUERY
    long = (~short).nonzero().flatten().tolist()
    lens = torch.where(short, q_lens, 0)
    num_rows = int(lens.sum())
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs), lens, output_size=num_rows)
    starts = meta.query_start_loc[:-1].to(torch.int64)
    first_row = torch.cumsum(lens, 0) - lens  # each sequence's first row
    offset = torch.arange(num_rows) - first_row[seq]  # the row's index within its query
    token = starts[seq] + offset
    pos = meta.seq_lens.to(torch.int64)[seq] - q_lens[seq] + offset
    return _RowPlan(token, seq, pos, long)


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dispatch.paged_attention's semantics on CPU tensors; torch.ops.kvpool_cpu must be loaded."""
    out = torch.empty_like(query) if out is None else out
    check_attention(query, kv_cache, meta, out)
    if query.device.type != "cpu":
        raise ValueError(f"the CPU attention op got {query.device} tensors")
    plan = meta.derived(("cpu_rows",), lambda: _build_rows(meta))
    if plan.token.numel():
        torch.ops.kvpool_cpu.paged_attention_rows(
            out, query, kv_cache, meta.block_tables, plan.token, plan.seq, plan.pos, meta.scale,
            meta.softcap or 0.0, meta.sliding_window or 0,
        )
    for s in plan.long:
        reference.prefill_into(query, kv_cache, meta, s, out)
    return out
