"""Split-KV (flash-decoding) decode against the reference, and the heuristic that picks it."""

from __future__ import annotations

import pytest
import torch
from kernel_factories import assert_close, gpu, make_batch, requires_cuda

from kvpool.kernels import AttentionInputError
from kvpool.kernels.decode_split_kv import decode_split_kv
from kvpool.kernels.dispatch import choose_num_splits
from kvpool.kernels.reference import paged_attention_ref

SEQ_LENS = [1, 17, 129, 333]


@pytest.mark.parametrize(
    "num_splits,num_heads,num_kv_heads,head_size,block_size,dtype",
    [
        (1, 2, 2, 64, 16, torch.float32),
        (3, 4, 1, 80, 32, torch.float16),  # splits end mid-block
        (7, 8, 1, 128, 16, torch.float32),  # most splits are empty for the short contexts
        (4, 8, 2, 96, 16, torch.float16),
    ],
)
def test_split_kv_matches_reference(num_splits, num_heads, num_kv_heads, head_size, block_size, dtype):
    batch = make_batch(
        [1] * len(SEQ_LENS), SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=dtype,
    )
    assert_close(decode_split_kv(*batch.args(), num_splits), paged_attention_ref(*batch.args()))


@pytest.mark.parametrize("window,softcap", [(50, None), (None, 4.0), (130, 8.0)])
def test_split_kv_window_and_softcap(window, softcap):
    batch = make_batch([1] * 4, SEQ_LENS, num_heads=4, num_kv_heads=1, head_size=64)
    batch.query *= 3
    got = decode_split_kv(*batch.args(sliding_window=window, softcap=softcap), 5)
    want = paged_attention_ref(*batch.args(sliding_window=window, softcap=softcap))
    assert_close(got, want)


def test_split_kv_with_wide_padded_block_table():
    # The block table is padded far past every context (as for a fixed max_model_len), so
    # whole splits fall beyond seq_len and must weigh nothing in the merge.
    batch = make_batch([1, 1], [20, 70], num_heads=2, num_kv_heads=1, extra_cols=12)
    assert_close(decode_split_kv(*batch.args(), 6), paged_attention_ref(*batch.args()))


def test_split_kv_rejects_a_prefill_batch():
    batch = make_batch([2, 1], [5, 9])
    with pytest.raises(AttentionInputError, match="one query token per sequence"):
        decode_split_kv(*batch.args(), 2)


def test_split_kv_rejects_empty_queries_beside_a_long_one():
    # As many tokens as sequences, but not one each: not a decode batch.
    batch = make_batch([2, 0], [5, 9])
    with pytest.raises(AttentionInputError, match="one query token per sequence"):
        decode_split_kv(*batch.args(), 2)


@pytest.mark.parametrize(
    "num_seqs,decode_only,num_kv_heads,max_context,num_sms,expected",
    [
        (1, True, 8, 32768, 132, 64),  # 8 programs want 66 splits: capped at 64
        (1, True, 8, 4096, 132, 8),  # at most one split per 512 positions
        (16, True, 8, 4096, 132, 5),  # ceil(4 * 132 / 128)
        (64, True, 8, 32768, 132, 2),  # 512 programs: ceil(528 / 512)
        (128, True, 8, 32768, 132, 1),  # 1024 programs already fill the GPU
        (1, True, 8, 512, 132, 1),  # short context: nothing to split
        (2, False, 8, 32768, 132, 1),  # a prefill in the batch: the one-pass kernel
        (0, True, 8, 32768, 132, 1),
    ],
)
def test_choose_num_splits(num_seqs, decode_only, num_kv_heads, max_context, num_sms, expected):
    assert choose_num_splits(num_seqs, decode_only, num_kv_heads, max_context, num_sms) == expected


@gpu
@requires_cuda
def test_split_kv_bf16_on_gpu():
    batch = make_batch(
        [1] * 3, [17, 1000, 4097], num_heads=32, num_kv_heads=8, head_size=128,
        dtype=torch.bfloat16,
    )
    assert_close(decode_split_kv(*batch.args(), 16), paged_attention_ref(*batch.args()))
