"""The oneDNN-packed projections (worker/cpu_linear.py) compute what nn.Linear computes, replace
every projection of a loaded model, and leave the greedy output of the worker unchanged (the
transformers parity of packed models: tests/worker/test_hf_parity.py, through build_engine)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import WorkerConfig
from kvpool.worker.cpu_linear import (
    PackedLinear,
    can_pack,
    dtype_packable,
    pack_linears,
    packing_available,
)
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.startup import build_engine

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 8, 37, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_the_dense_one_does(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    dense = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    want = dense(x)
    got = PackedLinear(dense)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_is_packed_where_the_cpu_can_and_left_dense_where_it_cannot() -> None:
    """oneDNN packs bf16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: where it
    can, the packed projection stays close to the dense one; where it cannot, a bf16 model is
    left dense and still runs (packing it raised on such a CPU)."""
    torch.manual_seed(0)
    dense = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    if dtype_packable(torch.bfloat16):
        torch.testing.assert_close(PackedLinear(dense)(x).float(), dense(x).float(), rtol=2e-2, atol=2e-2)
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(dense.weight.detach(), 8)
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == (1 if dtype_packable(torch.bfloat16) else 0)
    torch.testing.assert_close(model(x).float(), expected.float(), rtol=2e-2, atol=2e-2)


def _engine(packed: bool):
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=8 << 20, block_size=16,
                       max_model_len=128, packed_weights=packed)
    return build_engine(cfg, LocalBlockManager("packed", max_blocks=64))


def test_the_worker_packs_every_projection_and_samples_the_same_tokens() -> None:
    packed, dense = _engine(True), _engine(False)
    kinds = {type(m) for m in packed.model.modules()}
    assert PackedLinear in kinds and nn.Linear not in kinds
    assert PackedLinear not in {type(m) for m in dense.model.modules()}
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 3, [40, 41, 42], list(range(3, 40))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert packed.generate(prompts, params) == dense.generate(prompts, params)


def test_nothing_is_packed_off_the_cpu_or_in_an_unpackable_dtype() -> None:
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.float16)
    assert not can_pack(model)
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.parametrize("bias", [False, True])
def test_linears_of_one_input_merge_into_one_product(bias: bool) -> None:
    torch.manual_seed(1)
    q, k, v = nn.Linear(64, 96, bias=bias), nn.Linear(64, 32, bias=bias), nn.Linear(64, 32, bias=bias)
    x = torch.randn(5, 64)
    want = torch.cat([q(x), k(x), v(x)], dim=-1)
    torch.testing.assert_close(PackedLinear(q, k, v)(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="all or no biases"):
        PackedLinear(nn.Linear(64, 8, bias=True), nn.Linear(64, 8, bias=False))


def test_packing_merges_qkv_and_gate_up_of_every_layer() -> None:
    engine = _engine(True)
    for layer in engine.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert type(attn.qkv_proj) is PackedLinear and attn.q_proj is attn.k_proj is attn.v_proj is None
        assert type(mlp.gate_up_proj) is PackedLinear and mlp.gate_proj is mlp.up_proj is None
        assert type(attn.o_proj) is PackedLinear and type(mlp.down_proj) is PackedLinear
