"""The mixed prefill + decode Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_factories import DEVICE, assert_close, gpu, make_batch, requires_cuda

from kvpool.kernels import AttentionInputError
from kvpool.kernels.paged_attention_triton import paged_attention
from kvpool.kernels.reference import paged_attention_ref
from kvpool.kernels.reshape_and_cache_triton import reshape_and_cache

# Contexts 1, 17, 129, 300, 333 (none a block multiple): a 1-token sequence, a whole prompt,
# a 5-token chunk after a cached prefix, a decode step, and a 30-token chunk after a prefix.
MIXED = dict(q_lens=[1, 17, 5, 1, 30], seq_lens=[1, 17, 129, 300, 333])


def _compare(batch, **kwargs):
    tile_n = kwargs.pop("tile_n", None)
    got = paged_attention(*batch.args(**kwargs), tile_n=tile_n)
    want = paged_attention_ref(*batch.args(**kwargs))
    assert_close(got, want)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,dtype,tile_n",
    [
        (2, 2, 64, 16, torch.float32, 32),  # GQA 1
        (4, 1, 80, 32, torch.float16, 32),  # GQA 4, head 80
        (8, 1, 128, 16, torch.float16, 64),  # GQA 8, a tile spans 4 blocks
        (8, 2, 80, 32, torch.float32, 16),  # a block spans 2 tiles
        (6, 2, 96, 16, torch.float16, 32),  # GQA 3: query rows padded past the group
    ],
)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_size, block_size, dtype, tile_n):
    batch = make_batch(
        **MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=dtype, extra_cols=1,
    )
    _compare(batch, tile_n=tile_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batch_matches_reference(dtype):
    batch = make_batch(
        [1] * 5, [1, 16, 17, 129, 310], num_heads=8, num_kv_heads=1, head_size=128,
        block_size=32, dtype=dtype,
    )
    _compare(batch)


@pytest.mark.parametrize("window", [1, 16, 100])
def test_sliding_window_matches_reference(window):
    batch = make_batch(**MIXED, num_heads=4, num_kv_heads=2, head_size=64)
    _compare(batch, sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_matches_reference(dtype):
    batch = make_batch(**MIXED, num_heads=4, num_kv_heads=1, head_size=80, dtype=dtype)
    batch.query *= 4  # large logits, so the cap actually bends them
    _compare(batch, softcap=5.0)


def test_window_and_softcap_together():
    batch = make_batch([40, 1], [200, 64], num_heads=4, num_kv_heads=1, head_size=64)
    _compare(batch, sliding_window=33, softcap=2.0)


def test_many_sequences_and_an_empty_query():
    # Nine sequences exercise the kernel's binary search; sequence 3 has no new token.
    q_lens = [1, 3, 1, 0, 2, 1, 20, 1, 1]
    seq_lens = [5, 3, 40, 7, 18, 1, 20, 33, 2]
    batch = make_batch(q_lens, seq_lens, num_heads=2, num_kv_heads=1, head_size=64)
    _compare(batch)


def test_strided_query_and_out_buffer():
    batch = make_batch(**MIXED, num_heads=4, num_kv_heads=2, head_size=64)
    qkv = torch.randn(batch.query.shape[0], 8, 64, device=DEVICE)
    batch.query = qkv[:, :4]  # a view of a fused projection: token stride 8 * 64
    out = torch.full((batch.query.shape[0], 4, 64), float("nan"), device=DEVICE)
    got = paged_attention(*batch.args(), out=out)
    assert got is out
    assert_close(got, paged_attention_ref(*batch.args()))


def test_attention_over_tokens_written_by_reshape_and_cache():
    # The worker's order: write the new tokens' K/V into their slots, then attend.
    batch = make_batch([6, 1], [20, 35], num_heads=4, num_kv_heads=2, head_size=80)
    block_size = batch.kv_cache.shape[2]
    slots = []
    for s, (q_len, seq_len) in enumerate([(6, 20), (1, 35)]):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(batch.meta.block_tables[s, pos // block_size]) * block_size + pos % block_size)
    assert batch.meta.slot_mapping.tolist() == slots  # the metadata's own slot mapping agrees
    new_k, new_v = torch.randn(2, 7, 2, 80, device=DEVICE)
    reshape_and_cache(new_k, new_v, batch.kv_cache, batch.meta.slot_mapping)
    got = paged_attention(*batch.args())
    assert_close(got, paged_attention_ref(*batch.args()))
    # The last token of sequence 1 sees only itself at window 1: its output is its own V.
    last = paged_attention(*batch.args(sliding_window=1))[-1]
    assert_close(last, new_v[-1].repeat_interleave(2, dim=0))


def test_rejects_mismatched_head_size():
    batch = make_batch([1], [4], head_size=64)
    with pytest.raises(AttentionInputError, match="head_size"):
        paged_attention(batch.query[..., :32], *batch.args()[1:])


@gpu
@requires_cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(32, 8, 128), (8, 2, 80)])
def test_bf16_matches_reference_on_gpu(num_heads, num_kv_heads, head_size):
    batch = make_batch(
        **MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        dtype=torch.bfloat16,
    )
    _compare(batch)
    _compare(batch, sliding_window=64, softcap=30.0)
