"""Edges of the public paged_attention, both backends, against a float64 truth.

Each backend ("torch": the CPU reference; "triton": the kernels, under the interpreter here)
must compute the same answer and accept or refuse the same inputs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_factories import DEVICE, assert_close, make_batch, naive_attention

import kvpool.kernels as kernels
from kvpool.kernels import AttentionInputError, AttentionMetadata, dispatch
from kvpool.kernels.attention_common import choose_tiles

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("path", BACKENDS)
@pytest.mark.parametrize("q_lens,seq_lens", [([2, 0], [1100, 17]), ([3, 0, 0], [1029, 129, 1])])
def test_empty_queries_beside_a_long_context_are_not_decode(backend, path, q_lens, seq_lens):
    # As many tokens as sequences and a context past 1024 positions: the old test
    # (num_tokens == num_seqs) sent this to split-KV decode, which assumes one token each.
    backend(path)
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=80, block_size=16)
    assert_close(kernels.paged_attention(*batch.args()), naive_attention(batch))
    assert not batch.meta.is_decode_only(batch.query.shape[0])
    assert dispatch.decode_splits(*batch.args()) == 1


@pytest.mark.parametrize("path", BACKENDS)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,q_lens,seq_lens",
    [
        (3, 1, 80, 16, [1, 17, 4, 0], [1, 17, 129, 17]),
        (6, 2, 96, 32, [1, 1, 1], [1, 17, 129]),  # decode only
        (4, 4, 96, 16, [0, 9, 1], [129, 17, 1]),
    ],
)
def test_odd_shapes_match_float64(backend, path, num_heads, num_kv_heads, head_size, block_size,
                                  q_lens, seq_lens):
    backend(path)
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, extra_cols=2, seed=5)
    for options in ({}, {"sliding_window": 5, "softcap": 2.5}):
        got = kernels.paged_attention(*batch.args(**options))
        assert_close(got, naive_attention(batch, **options))


@pytest.mark.parametrize("path", BACKENDS)
def test_minus_one_padding_in_block_tables(backend, path):
    # Decode rows of different lengths share one gathered width on the CPU path: the short
    # row's padding (-1 here) is inside that width and used to be indexed.
    backend(path)
    batch = make_batch([1, 1, 5], [5, 70, 40], num_heads=2, num_kv_heads=1, block_size=16, extra_cols=2)
    padded = batch.meta.block_tables.clone()
    needed = (batch.meta.seq_lens + 15) // 16
    padded[torch.arange(padded.shape[1], device=padded.device) >= needed[:, None]] = -1
    meta = replace(batch.meta, block_tables=padded)
    assert (meta.block_tables == -1).sum() > 0
    got = kernels.paged_attention(batch.query, batch.kv_cache, meta)
    assert_close(got, naive_attention(batch))


def test_bf16_under_the_interpreter_is_refused(backend):
    backend("triton")
    batch = make_batch([3, 1], [9, 30], dtype=torch.bfloat16, device="cpu")
    with pytest.raises(AttentionInputError, match="bf16 attention under the Triton interpreter"):
        kernels.paged_attention(*batch.args())
    decode = make_batch([1, 1], [40, 1100], dtype=torch.bfloat16, device="cpu")
    with pytest.raises(AttentionInputError, match="bf16 attention under the Triton interpreter"):
        kernels.paged_attention(*decode.args())
    backend("torch")  # the reference computes bf16 in fp32: fine on CPU
    assert_close(kernels.paged_attention(*batch.args()), naive_attention(batch))


def _meta(**changes) -> AttentionMetadata:
    # On the CPU, where the value checks run (on CUDA they would read device memory).
    i32 = dict(dtype=torch.int32)
    fields = dict(
        query_start_loc=torch.tensor([0, 2], **i32), seq_lens=torch.tensor([5], **i32),
        block_tables=torch.tensor([[1]], **i32), max_query_len=2, max_seq_len=5, scale=0.1,
    )
    return AttentionMetadata(**{**fields, **changes})


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"seq_lens": torch.tensor([5], dtype=torch.int64)}, "seq_lens must be torch.int32"),
        ({"block_tables": torch.tensor([[1]])}, "block_tables must be torch.int32"),
        ({"slot_mapping": torch.tensor([4, 5], dtype=torch.int32)}, "slot_mapping must be 1-D int64"),
        ({"sliding_window": 0}, r"sliding_window must be None \(no window\) or an int >= 1"),
        ({"softcap": 0.0}, r"softcap must be None \(no capping\) or a finite number > 0"),
        ({"max_query_len": 1}, "max_query_len 1 is below the longest query"),
        ({"max_seq_len": 4}, "max_seq_len 4 is below the longest sequence"),
        ({"seq_lens": torch.tensor([1], dtype=torch.int32)}, "a query is longer than its sequence"),
    ],
)
def test_metadata_refuses_what_no_path_handles(changes, message):
    _meta()  # the unchanged fields are fine
    with pytest.raises(AttentionInputError, match=message):
        _meta(**changes)


def _bad_inputs(case: str):
    batch = make_batch([2, 1], [9, 30], num_heads=4, num_kv_heads=2)
    query, cache, meta = batch.args()
    if case == "heads":
        return query[:, :3], cache, meta
    if case == "dtype":
        return query, cache.half(), meta
    if case == "block_id":
        table = meta.block_tables.clone()
        table[1, 1] = cache.shape[1]  # inside the sequence's 30 positions, past the cache
        return query, cache, replace(meta, block_tables=table)
    if case == "tokens":
        return query[:2], cache, meta
    raise AssertionError(case)


@pytest.mark.parametrize("path", BACKENDS)
@pytest.mark.parametrize(
    "case,message",
    [
        ("heads", "query has 3 heads, not a multiple of the cache's 2 kv heads"),
        ("dtype", "cast the query to the cache dtype"),
        ("block_id", r"block_tables name blocks outside \[0, "),
        ("tokens", "query has 2 tokens, query_start_loc says 3"),
    ],
)
def test_both_paths_refuse_the_same_inputs(backend, path, case, message):
    if DEVICE != "cpu" and case in ("block_id", "tokens"):
        pytest.skip("value checks read tensor contents: CPU only")
    backend(path)
    with pytest.raises(AttentionInputError, match=message):
        kernels.paged_attention(*_bad_inputs(case))


@pytest.mark.parametrize(
    "num_heads,head_size,q_lens,seq_lens,rows",
    [(4, 256, [40, 1], [45, 17], 32), (2, 512, [1, 40], [3, 45], 16)],
)
def test_large_heads_with_their_smaller_tiles_match_float64(backend, num_heads, head_size, q_lens,
                                                            seq_lens, rows):
    backend("triton")
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=1, head_size=head_size)
    avg_rows = batch.query.shape[0] / len(q_lens)
    assert choose_tiles(head_size, avg_rows, num_heads, 4).block_m == rows
    assert_close(kernels.paged_attention(*batch.args()), naive_attention(batch))


@pytest.mark.parametrize("path", BACKENDS)
def test_per_layer_options_share_the_checked_batch(backend, path):
    # A model whose layers differ in window (Qwen2's sliding layers) swaps only the options.
    backend(path)
    batch = make_batch([3, 1], [20, 9], num_heads=2, num_kv_heads=1)
    layer = batch.meta.with_options(sliding_window=4, softcap=3.0)
    assert layer.block_tables is batch.meta.block_tables and batch.meta.sliding_window is None
    assert_close(kernels.paged_attention(batch.query, batch.kv_cache, layer),
                 naive_attention(batch, sliding_window=4, softcap=3.0))
    with pytest.raises(AttentionInputError, match="sliding_window must be None"):
        batch.meta.with_options(sliding_window=0)
