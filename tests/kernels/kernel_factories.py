"""Tiny factories for kernel tests: paged batches with shuffled block tables."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

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
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    scale: float

    def args(self) -> tuple:
        return (
            self.query, self.kv_cache, self.query_start_loc, self.seq_lens, self.block_table,
            self.scale,
        )


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
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist()])
    return Batch(
        query=query.to(device, dtype),
        kv_cache=cache.to(device, dtype),
        query_start_loc=qsl.to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        scale=head_size**-0.5,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, f"{actual.dtype} != {expected.dtype}"
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
