"""The per-layer ops of a decoder step: RMSNorm (with the residual add), RoPE, SiLU-and-multiply.

On CPU tensors, where the C++ library loaded (cpu_build.py) and the backend is "auto" or "cpu",
each is one pass of csrc/layer_ops_cpu.cpp; elsewhere (CUDA, backend "torch", no compiler) the
torch reference of reference.py, which is what the model computed before. A decode step is a
handful of rows, so the torch versions' several ops and allocations a call, not arithmetic, were
their cost. The C++ versions may write into their inputs (said per function).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import reference
from .dispatch import cpu_native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, r) with r = x + residual (x without one), normed = weight * r / rms(r); x, r
    [rows, n]. ``residual`` may be updated in place to hold r."""
    if not cpu_native(x) or x.dim() != 2:
        return reference.rms_norm_ref(x, weight, eps, residual)
    out = torch.empty_like(x)
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    torch.ops.kvpool_cpu.rms_norm(out, residual, x, weight, eps)
    return out, x if residual is None else residual


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rows: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_size] at ``positions`` (int64 [tokens]) from
    fp32 tables [max_position, head_size / 2]; may rotate x in place and return it. ``rows``
    gives the tables' rows of ``positions`` ([tokens, 1, head_size / 2] each) to the torch path,
    which a caller looks up once for every layer of a step."""
    native = (cpu_native(x) and x.dim() == 3 and x.stride(-1) == 1 and positions.dtype == torch.int64
              and positions.is_contiguous())
    if not native:
        c, s = rows() if rows is not None else (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
        return reference.rope_ref(x, c, s)
    torch.ops.kvpool_cpu.rope_(x, positions, cos, sin)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [rows, 2n] (gate first) -> [rows, n]."""
    if not cpu_native(gate_up) or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return reference.silu_mul_ref(gate, up)
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.kvpool_cpu.silu_mul(out, gate_up)
    return out
