"""Memory profiling: how many bytes the KV cache may take (DESIGN.md, "Memory profiling").

    available_kv = total * memory_utilization - (weights + activation_peak + non_torch_growth)

``kv_cache_budget`` is the pure arithmetic over a ``MemoryProfile``; ``profile_cuda`` and
``profile_cpu`` measure one. On CUDA the profile is measured: weights and the peak of a dummy
forward at ``max_num_batched_tokens`` from the allocator's stats, non-torch growth (CUDA context,
cuBLAS workspaces) from ``mem_get_info``. On CPU the "device" is a host-memory budget, weights are
counted and the activation peak is read from the process's peak RSS where Linux allows it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)
GiB = float(1 << 30)


class KVMemoryError(ValueError):
    """The configuration cannot give the KV cache enough memory; the message says what to change."""


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # device memory (CPU: the host budget), bytes
    weights: int
    activation_peak: int  # peak of a dummy forward over the weights
    non_torch: int = 0  # growth outside the torch allocator during start-up
    used_by_others: int = 0  # memory other processes held when the worker started


def page_bytes(block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block in one layer (K and V)."""
    return 2 * block_size * num_kv_heads * head_size * torch.empty((), dtype=dtype).element_size()


def kv_cache_budget(p: MemoryProfile, memory_utilization: float) -> int:
    """Bytes the KV cache may take; raises KVMemoryError saying what to change."""
    requested = int(p.total * memory_utilization)
    if p.used_by_others > p.total - requested:
        raise KVMemoryError(
            f"other processes hold {p.used_by_others / GiB:.2f} GiB of {p.total / GiB:.2f} GiB, "
            f"so {memory_utilization:.0%} of it is not free; lower memory_utilization to "
            f"<= {(p.total - p.used_by_others) / p.total:.2f} or free the device"
        )
    non_kv = p.weights + p.activation_peak + p.non_torch
    available = requested - non_kv
    if available <= 0:
        raise KVMemoryError(
            f"no memory left for the KV cache: {memory_utilization:.0%} of {p.total / GiB:.2f} GiB "
            f"is {requested / GiB:.2f} GiB but weights take {p.weights / GiB:.2f} GiB, the forward "
            f"peak {p.activation_peak / GiB:.2f} GiB and non-torch memory {p.non_torch / GiB:.2f} "
            f"GiB; raise memory_utilization, lower max_num_batched_tokens or use a smaller model"
        )
    return available


def num_blocks_for(available_kv: int, page: int, num_layers: int) -> int:
    """Blocks that fit ``available_kv`` bytes, counting the null block 0 as one of them."""
    return available_kv // (page * num_layers)


def check_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Refuses a pool that cannot hold one max_model_len request (block 0 is never usable)."""
    need = -(-max_model_len // block_size)
    if num_blocks - 1 < need:
        raise KVMemoryError(
            f"the KV cache has {max(num_blocks - 1, 0)} usable blocks of {block_size} tokens but one "
            f"max_model_len={max_model_len} request needs {need}; raise memory_utilization or "
            f"kv_cache_memory, or lower max_model_len or max_num_batched_tokens"
        )


def profile_cuda(load_weights: Callable[[], object], dummy_forward: Callable[[], None],
                 device: torch.device) -> MemoryProfile:
    """Measures a CUDA start-up: ``load_weights`` then ``dummy_forward`` at the token budget."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info(device)
    alloc0, reserved0 = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    load_weights()
    weights = torch.cuda.memory_allocated(device) - alloc0
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    dummy_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    free1, _ = torch.cuda.mem_get_info(device)
    non_torch = ((total - free1) - torch.cuda.memory_reserved(device)) - ((total - free0) - reserved0)
    others = (total - free0) - reserved0
    return MemoryProfile(total, weights, peak, max(non_torch, 0), max(others, 0))


def _peak_rss() -> int | None:
    """Peak resident set size of this process, after resetting it (Linux only)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def profile_cpu(model: torch.nn.Module, dummy_forward: Callable[[], None], budget: int,
                activation_estimate: int) -> MemoryProfile:
    """A host-memory profile: counted weights, measured (or estimated) forward peak."""
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    base = _peak_rss() if _reset_peak_rss() else None
    dummy_forward()
    peak = _peak_rss()
    measured = peak - base if base is not None and peak is not None else 0
    return MemoryProfile(budget, weights, max(measured, activation_estimate))


def activation_estimate(num_tokens: int, hidden: int, intermediate: int, num_heads: int,
                        head_size: int, vocab: int, dtype_bytes: int) -> int:
    """Rough bytes live at once in a forward over ``num_tokens`` (a floor for the CPU profile)."""
    per_token = (4 * hidden + 3 * intermediate + 3 * num_heads * head_size) * dtype_bytes
    return num_tokens * per_token + vocab * 4 * 64  # logits only for sampled rows
