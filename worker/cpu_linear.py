"""The model's projections on oneDNN's blocked weight layout, for CPU inference.

A decode step multiplies a handful of token rows by every weight matrix, so on a CPU it is bound
by how fast the weights stream from memory, not by arithmetic. ``F.linear`` reads each row-major
weight as it lies; oneDNN, given the weight once in its own blocked layout
(``mkldnn._reorder_linear_weight``), streams it in the order its kernel consumes it. On this
project's benchmark model (hidden 512, 8 layers, fp32, one thread, weights read from memory each
step) the 56 projections of a decode step of 8 rows took 8.3 ms against 14.5 ms, and 1.2-1.4x
less at prefill sizes (64-512 rows): ``scripts/bench_step_parts.py --linear``. vLLM's CPU backend
prepacks its weights for oneDNN likewise.

``pack_linears`` swaps every ``nn.Linear`` of a loaded (and, with tensor parallelism, sharded)
model for a ``PackedLinear`` holding only the packed weight, so the weights are not held twice.
Projections that read the same input become one product, as vLLM's merged linears are: q, k and
v one ``qkv_proj``, gate and up one ``gate_up_proj`` (fewer, wider products: 3-8% less time for
the projections of a decode step of 8 rows, and 4 calls a layer instead of 7).
It runs after memory profiling and after checkpoint loading; nothing reads a projection's
``.weight`` after that (tied embeddings keep their dense table: the embedding lookup needs it).
The sums are fp32 in another order than ``F.linear``'s: results differ in the last bits (a few
1e-6 relative), as two BLAS libraries do.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 8  # rows the packed layout is tuned for: a decode step (any row count works)
# (the model's attribute for the merged product, the projections it merges): worker/model.py
_FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def packing_available() -> bool:
    """oneDNN is built in and exposes the prepacked linear ops (PyTorch's CPU builds do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed weight (input [rows, in_features]); given
    several linears of one input, their outputs side by side (weights stacked by rows)."""

    def __init__(self, *linears: nn.Linear) -> None:
        super().__init__()
        first = linears[0]
        if any(lin.in_features != first.in_features for lin in linears) or len(
                {lin.bias is None for lin in linears}) != 1:
            raise ValueError("linears fused into one product need one input size and all or no biases")
        self.in_features = first.in_features
        self.out_features = sum(lin.out_features for lin in linears)
        with torch.no_grad():
            weight = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else first.weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
            bias = None if first.bias is None else torch.cat([lin.bias.detach() for lin in linears])
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = first.bias if len(linears) == 1 else (None if bias is None else nn.Parameter(bias, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


@functools.cache
def dtype_packable(dtype: torch.dtype) -> bool:
    """oneDNN packs ``dtype`` on this CPU: bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    which not every x86 CPU has, so a tiny weight is packed once to find out."""
    if dtype not in PACKABLE_DTYPES or not packing_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), _BATCH_HINT)
    except RuntimeError as e:
        logger.info("oneDNN does not pack %s on this CPU (%s): dense projections", dtype, e)
        return False
    return True


def can_pack(model: nn.Module) -> bool:
    """The model's weights live on the CPU in a dtype oneDNN packs there, and the ops exist."""
    p = next(model.parameters())
    return p.device.type == "cpu" and dtype_packable(p.dtype)


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replaces every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (in place); returns how
    many. A no-op (0) where ``can_pack`` is False."""
    if not can_pack(model):
        return 0
    fused = 0
    for module in model.modules():
        for target, parts in _FUSED:
            linears = [getattr(module, name, None) for name in parts]
            if hasattr(module, target) and all(type(lin) is nn.Linear for lin in linears):
                setattr(module, target, PackedLinear(*linears))
                for name in parts:
                    setattr(module, name, None)  # the dense weights go
                fused += 1
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))  # the dense weight goes with the old module
    logger.info("packed %d projections for oneDNN (%d of them merged products)", len(swaps) + fused, fused)
    return len(swaps) + fused
