"""Batch metadata and the paged forward pass against the contiguous reference."""

from __future__ import annotations

import random

import pytest
import torch

from kvpool.worker.config import ModelConfig
from kvpool.worker.kv_cache import allocate_kv_caches
from kvpool.worker.model import build_model
from kvpool.worker.reference import ContiguousKV
from kvpool.worker.runner import ModelRunner, build_metadata
from kvpool.worker.step_plan import Batch, BatchSeq


def test_metadata_exact():
    plan = Batch([BatchSeq([7, 8, 9], 0, [5, 2], True), BatchSeq([4], 5, [3, 9], True),
                     BatchSeq([1, 2], 2, [6], False)])
    m = build_metadata(plan, 4, "cpu")
    assert m.input_ids.tolist() == [7, 8, 9, 4, 1, 2]
    assert m.positions.tolist() == [0, 1, 2, 5, 2, 3]
    a = m.attn
    assert a.query_start_loc.tolist() == [0, 3, 4, 6] and a.query_start_loc.dtype == torch.int32
    assert a.seq_lens.tolist() == [3, 6, 4] and a.seq_lens.dtype == torch.int32
    assert a.block_tables.tolist() == [[5, 2], [3, 9], [6, 0]] and a.block_tables.dtype == torch.int32
    assert a.slot_mapping.tolist() == [20, 21, 22, 37, 26, 27]  # block * 4 + offset
    assert a.slot_mapping.dtype == torch.int64
    assert (a.max_query_len, a.max_seq_len) == (3, 6)
    assert m.logits_indices.tolist() == [2, 3]


ODD = ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=80, num_layers=2, num_heads=6,
                  num_kv_heads=2, head_size=16, qkv_bias=True, tie_embeddings=True, name="odd")


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_logits_match_contiguous(block_size):
    """A prefill chunk, then a second chunk and a decode token, over out-of-order blocks."""
    model = build_model(ODD, torch.float32, "cpu", seed=3)
    rng = random.Random(block_size)
    tokens = [rng.randrange(ODD.vocab_size) for _ in range(29)]
    caches = allocate_kv_caches(2, 16, block_size, 2, 16, torch.float32, "cpu")
    runner = ModelRunner(model, caches, block_size)
    table = rng.sample(range(1, 16), -(-len(tokens) // block_size))
    ref = ContiguousKV(model, len(tokens))
    for start, end in ((0, 17), (17, 28), (28, 29)):
        paged = runner.execute(Batch([BatchSeq(tokens[start:end], start, table, True)]))
        ids = torch.tensor(tokens[start:end])
        hidden = model(ids, torch.arange(start, end), ref.attend_at(start))
        torch.testing.assert_close(paged, model.compute_logits(hidden[-1:]), atol=1e-4, rtol=1e-4)
