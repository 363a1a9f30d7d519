"""The C++ per-layer ops (kernels/layer_ops.py: RMSNorm with the residual add, RoPE, SiLU-and-
multiply, the cache write) against the torch reference, on odd sizes and in every dtype; and the
torch path they fall back to."""

from __future__ import annotations

import pytest
import torch
from kernel_factories import TOLERANCE

import kvpool.kernels as kernels
from kvpool.kernels import cpu_build, layer_ops, reference
from kvpool.worker.model import RotaryEmbedding

needs_op = pytest.mark.skipif(not cpu_build.load(), reason="the C++ CPU library did not build here")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    atol, rtol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 100), (3, 4096), (2, 8)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference_and_updates_the_residual(dtype, rows, n, with_residual):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(dtype)
    weight = (1 + torch.randn(n, generator=g)).to(dtype)
    residual = torch.randn(rows, n, generator=g).to(dtype) if with_residual else None
    want, want_r = reference.rms_norm_ref(x, weight, 1e-6, residual)
    held = None if residual is None else residual.clone()
    got, got_r = layer_ops.rms_norm(x, weight, 1e-6, held)
    _close(got, want)
    assert torch.equal(got_r, want_r)  # the add rounds once in the dtype, as torch's does
    if held is not None:
        assert got_r is held  # the residual stream was updated in place


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_size", [(1, 64), (3, 80), (2, 96), (4, 2)])
def test_rope_matches_the_reference_in_place(dtype, heads, head_size):
    rope = RotaryEmbedding(head_size, 300, 10000.0, None)
    g = torch.Generator().manual_seed(head_size)
    x = torch.randn(9, heads, head_size, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 129, 299, 3, 3, 64])
    want = reference.rope_ref(x, rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1))
    view = x.clone()
    got = layer_ops.rope(view, positions, rope.cos, rope.sin)
    assert got is view
    _close(got, want)


@needs_op
def test_rope_rotates_strided_rows_and_refuses_positions_past_the_table():
    rope = RotaryEmbedding(64, 10, 10000.0, None)
    qkv = torch.randn(3, 4 * 64)
    q = qkv[:, : 2 * 64].view(3, 2, 64)  # a split of a merged projection: rows strided by 256
    want = reference.rope_ref(q, rope.cos[torch.tensor([1, 2, 3])].unsqueeze(1), rope.sin[torch.tensor([1, 2, 3])].unsqueeze(1))
    layer_ops.rope(q, torch.tensor([1, 2, 3]), rope.cos, rope.sin)
    _close(q, want)
    with pytest.raises(RuntimeError, match="outside the table"):
        layer_ops.rope(torch.randn(1, 1, 64), torch.tensor([10]), rope.cos, rope.sin)


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 16), (5, 1536), (2, 37)])
def test_silu_mul_matches_the_reference(dtype, rows, n):
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -88.5, 90.0, 200.0]).to(dtype)  # far tails of exp
    want = reference.silu_mul_ref(*gate_up.chunk(2, dim=-1))
    _close(layer_ops.silu_mul(gate_up), want)


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cache_write_matches_the_reference_and_skips_minus_one(dtype, backend):
    key, value = torch.randn(4, 2, 80).to(dtype), torch.randn(4, 2, 80).to(dtype)
    slots = torch.tensor([9, -1, 0, 31])  # blocks of 16: block 0, offset 9; skip; 0/0; 1/15
    want = torch.zeros(2, 3, 16, 2, 80, dtype=dtype)
    reference.reshape_and_cache_ref(key, value, want, slots)
    backend("auto")
    got = torch.zeros_like(want)
    kernels.reshape_and_cache(key, value, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvpool_cpu.write_kv(key, value, got, torch.tensor([0, 1, 2, 48]))


@pytest.mark.parametrize("name", ["torch", "auto"])
def test_every_op_answers_on_either_path(backend, name):
    """Backend "torch" (or no library) takes the references; the results agree with "auto"."""
    backend(name)
    x, w = torch.randn(3, 64), torch.randn(64)
    normed, r = layer_ops.rms_norm(x, w, 1e-5, torch.ones(3, 64))
    _close(normed, reference.rms_norm_ref(x, w, 1e-5, torch.ones(3, 64))[0])
    rope = RotaryEmbedding(64, 8, 10000.0, None)
    pos = torch.tensor([0, 7, 2])
    q = torch.randn(3, 2, 64)
    _close(layer_ops.rope(q.clone(), pos, rope.cos, rope.sin),
           reference.rope_ref(q, rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)))
    gu = torch.randn(3, 64)
    _close(layer_ops.silu_mul(gu), reference.silu_mul_ref(*gu.chunk(2, dim=-1)))
