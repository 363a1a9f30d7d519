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


def packing_available() -> bool:
    """oneDNN is built in and exposes the prepacked linear ops (PyTorch's CPU builds do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed weight (input [rows, in_features])."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

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
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))  # the dense weight goes with the old module
    logger.info("packed %d projections for oneDNN", len(swaps))
    return len(swaps)
