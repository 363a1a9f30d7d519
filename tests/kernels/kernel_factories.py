"""Tiny factories for kernel tests: paged batches with shuffled block tables."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from kvpool.kernels import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) per dtype: fp16 loses ~1e-3 when probabilities are rounded for the P @ V dot.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    meta: AttentionMetadata

    def args(self, **options) -> tuple:
        """(query, kv_cache, meta), the metadata's options (sliding_window, softcap) replaced."""
        return self.query, self.kv_cache, replace(self.meta, **options) if options else self.meta


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_block_table(
    seq_lens: list[int], block_size: int, extra_cols: int = 0, seed: int = 0
) -> tuple[torch.Tensor, int]:
    """Block tables using a random permutation of block ids 1..n (0 is the null padding block).

    Returns (block_table int32 [num_seqs, max_blocks + extra_cols], num_blocks incl. null).
    """
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3  # the null block and two never-used blocks
    ids = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    table = torch.zeros(len(seq_lens), max(needed, default=0) + extra_cols, dtype=torch.int32)
    at = 0
    for s, n in enumerate(needed):
        table[s, :n] = ids[at : at + n]
        at += n
    return table, num_blocks


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    extra_cols: int = 0,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    """A batch where sequence s has q_lens[s] new tokens and seq_lens[s] tokens in all.

    The whole cache, null and unused blocks included, holds random values, so reading a wrong
    block shows up in the output.
    """
    assert all(q <= n for q, n in zip(q_lens, seq_lens, strict=True))
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = make_block_table(seq_lens, block_size, extra_cols, seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=g)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, table.tolist(), head_size**-0.5, block_size=block_size, device=device
    )
    return Batch(query=query.to(device, dtype), kv_cache=cache.to(device, dtype), meta=meta)


def naive_attention(batch: Batch, sliding_window=None, softcap=None) -> torch.Tensor:
    """Float64 truth, position by position: no block gather, no chunking, no fused kernels."""
    m = batch.meta
    block_size = batch.kv_cache.shape[2]
    cache = batch.kv_cache.double()
    outs = []
    qsl = m.query_start_loc.tolist()
    for s in range(len(qsl) - 1):
        seq_len, q_len = int(m.seq_lens[s]), qsl[s + 1] - qsl[s]
        rows = [cache[:, int(m.block_tables[s, p // block_size]), p % block_size] for p in range(seq_len)]
        kv = torch.stack(rows, dim=1) if rows else cache.new_zeros(2, 0, *cache.shape[3:])
        q = batch.query[qsl[s] : qsl[s + 1]].double().transpose(0, 1)  # [heads, q_len, d]
        group = q.shape[0] // kv.shape[2]
        k = kv[0].transpose(0, 1).repeat_interleave(group, 0)  # [heads, seq_len, d]
        v = kv[1].transpose(0, 1).repeat_interleave(group, 0)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        logits = q @ k.transpose(1, 2) * m.scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        o = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        outs.append(o.transpose(0, 1))
    return torch.cat(outs).to(batch.query.dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, f"{actual.dtype} != {expected.dtype}"
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
