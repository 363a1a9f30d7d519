"""The torch reference (the truth the kernels are held to) against naive float64 attention."""

from __future__ import annotations

import pytest
import torch
from kernel_factories import make_batch, make_block_table, naive_attention

from kvpool.kernels import reference
from kvpool.kernels.reference import copy_blocks_ref, paged_attention_ref, reshape_and_cache_ref

MIXED = dict(q_lens=[1, 17, 5, 1, 30], seq_lens=[1, 17, 129, 300, 333])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,softcap",
    [
        (2, 2, 64, 16, None, None),
        (4, 1, 80, 32, None, None),
        (8, 1, 128, 16, None, None),
        (4, 2, 96, 16, 7, None),
        (4, 1, 80, 16, None, 3.0),
        (8, 2, 64, 32, 50, 10.0),
    ],
)
def test_reference_matches_naive(num_heads, num_kv_heads, head_size, block_size, window, softcap):
    batch = make_batch(
        **MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, extra_cols=2, device="cpu",
    )
    got = paged_attention_ref(*batch.args(sliding_window=window, softcap=softcap))
    want = naive_attention(batch, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_chunking_matches_unchunked(monkeypatch):
    batch = make_batch([40, 1, 1, 1], [90, 5, 60, 33], num_heads=4, num_kv_heads=2, device="cpu")
    want = paged_attention_ref(*batch.args(sliding_window=20))
    # 7-query prefill chunks; decode rows one at a time (60 * (2 * 2 * 64 + 4) elements each).
    monkeypatch.setattr(reference, "_MAX_TEMP_ELEMS", 4 * 90 * 7)
    got = paged_attention_ref(*batch.args(sliding_window=20))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_reference_writes_into_out_in_query_dtype():
    batch = make_batch([3, 1], [10, 20], dtype=torch.float16, device="cpu")
    out = torch.full_like(batch.query, float("nan"))
    got = paged_attention_ref(*batch.args(), out=out)
    assert got is out and got.dtype == torch.float16 and not got.isnan().any()


def test_reshape_and_cache_ref_writes_slots_and_skips_minus_one():
    cache = torch.zeros(2, 5, 4, 2, 3)
    key, value = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    reshape_and_cache_ref(key, value, cache, torch.tensor([9, -1, 4]))
    expected = torch.zeros_like(cache)
    expected[0, 2, 1], expected[1, 2, 1] = key[0], value[0]  # slot 9 = block 2, offset 1
    expected[0, 1, 0], expected[1, 1, 0] = key[2], value[2]  # slot 4 = block 1, offset 0
    assert torch.equal(cache, expected)


def test_copy_blocks_ref_copies_k_and_v_in_every_layer():
    caches = [torch.randn(2, 6, 4, 1, 8) for _ in range(2)]
    before = [c.clone() for c in caches]
    copy_blocks_ref(caches, torch.tensor([[1, 4], [2, 5]]))
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 4], b[:, 1]) and torch.equal(c[:, 5], b[:, 2])
        assert torch.equal(c[:, :4], b[:, :4])


def test_block_table_factory_is_a_shuffled_partition():
    table, num_blocks = make_block_table([17, 1, 40], block_size=16, seed=3)
    used = torch.cat([table[0, :2], table[1, :1], table[2, :3]])
    assert sorted(used.tolist()) == sorted(set(used.tolist())) and 0 not in used.tolist()
    assert used.tolist() != sorted(used.tolist()) and int(used.max()) < num_blocks
