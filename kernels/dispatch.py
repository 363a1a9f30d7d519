"""Public kernel entry points: pick the Triton kernel, the C++ CPU op or the torch reference.

Backends: "auto" (default): Triton for CUDA tensors; for CPU tensors the C++ attention op
(paged_attention_cpu.py) where it is built (cpu_build.py), else the torch reference; "triton":
always Triton (CPU tensors then run under the interpreter, TRITON_INTERPRET=1 set before triton
is imported); "cpu": the C++ op, an error where it cannot be built; "torch": always the
reference. KVPOOL_KERNEL_BACKEND sets the initial backend. Triton is imported on first use only,
so this module imports where triton cannot; "auto" then falls back to the reference with a
warning. The cache write has a C++ op too (taken as attention's is); block copies run the
reference on CPU.
"""

from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace

import torch

from . import cpu_build, reference
from .checks import check_attention, check_cache_write
from .metadata import AttentionMetadata
from .paged_attention_cpu import paged_attention_cpu

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "cpu", "torch")

# Split-KV heuristic (flash-decoding); see choose_num_splits.
_PROGRAMS_PER_SM = 4  # resident programs per SM wanted to keep HBM busy
_MIN_SPLIT_CONTEXT = 512  # fewer positions per split cost more in merging than they gain
_MAX_SPLITS = 64
_INTERPRETER_SMS = 16  # nominal SM count when the interpreter stands in for a GPU


def _validate(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


_backend = _validate(os.environ.get("KVPOOL_KERNEL_BACKEND", "auto"))


def set_backend(name: str) -> None:
    """Select "auto", "triton" or "torch" for every later kernel call in this process."""
    global _backend
    _backend = _validate(name)


def get_backend() -> str:
    return _backend


@functools.cache
def _triton_ops() -> SimpleNamespace | None:
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from .copy_blocks_triton import copy_blocks
        from .decode_split_kv import decode_split_kv
        from .paged_attention_triton import _paged_attention_kernel, paged_attention
        from .reshape_and_cache_triton import reshape_and_cache
    except Exception as exc:  # any import failure means: no Triton on this machine
        logger.warning("Triton kernels unavailable (%s); using the torch reference", exc)
        return None
    return SimpleNamespace(
        reshape_and_cache=reshape_and_cache,
        paged_attention=paged_attention,
        decode_split_kv=decode_split_kv,
        copy_blocks=copy_blocks,
        # Decided when the kernels were decorated, i.e. by TRITON_INTERPRET at their import.
        interpret=isinstance(_paged_attention_kernel, InterpretedFunction),
    )


def cpu_native(t: torch.Tensor) -> bool:
    """Whether an op on CPU tensors like t runs the C++ library: backend "auto" or "cpu", CPU
    tensors, the library loaded (layer_ops.py and the cache write ask this)."""
    return _backend in ("auto", "cpu") and t.device.type == "cpu" and cpu_build.load()


def _cpu_attention(t: torch.Tensor) -> bool:
    """Whether attention on tensors like t runs the C++ CPU op."""
    if _backend == "cpu":
        if t.device.type != "cpu" or not cpu_build.load():
            raise RuntimeError(
                f"kernel backend 'cpu' was requested but the C++ CPU op cannot run here ("
                f"{'tensors on ' + str(t.device) if t.device.type != 'cpu' else 'it did not build: see the log'})"
            )
        return True
    return _backend == "auto" and t.device.type == "cpu" and cpu_build.load()


def _ops_for(t: torch.Tensor) -> SimpleNamespace | None:
    """The Triton ops to use for a call on tensors like t, or None for the reference."""
    if _backend in ("torch", "cpu") or (_backend == "auto" and not t.is_cuda):
        return None
    ops = _triton_ops()
    if ops is None:
        if _backend == "triton":
            raise RuntimeError("kernel backend 'triton' was requested but triton cannot be imported")
        return None
    if not t.is_cuda and not ops.interpret:
        raise RuntimeError(
            "Triton kernels got CPU tensors: set TRITON_INTERPRET=1 before triton is imported, "
            "or use set_backend('torch')"
        )
    return ops


def choose_num_splits(
    num_seqs: int, decode_only: bool, num_kv_heads: int, max_context: int, num_sms: int
) -> int:
    """How many ways to split each context for decode (1 = use the one-pass kernel).

    Split only decode-only batches (every sequence has exactly one new token) whose (sequence,
    kv head) programs cannot fill _PROGRAMS_PER_SM per SM: split enough to reach that, but keep
    at least _MIN_SPLIT_CONTEXT positions per split. max_context bounds the contexts (the
    metadata's max_seq_len, a host value, so no device sync is needed).
    """
    programs = num_seqs * num_kv_heads
    if not decode_only or programs == 0:
        return 1
    wanted = -(-_PROGRAMS_PER_SM * num_sms // programs)
    splits = min(wanted, max_context // _MIN_SPLIT_CONTEXT, _MAX_SPLITS)
    return splits if splits >= 2 else 1


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def decode_splits(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> int:
    """choose_num_splits for this batch on this device (what the Triton path will launch)."""
    return choose_num_splits(
        meta.num_seqs, meta.is_decode_only(query.shape[0]), kv_cache.shape[3], meta.max_seq_len,
        _num_sms(query.device),
    )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_size] into kv_cache slots (-1 = skip)."""
    if cpu_native(kv_cache) and kv_cache.stride(3) == kv_cache.shape[4]:
        check_cache_write(key, value, kv_cache, slot_mapping)
        torch.ops.kvpool_cpu.write_kv(key, value, kv_cache, slot_mapping)
        return
    ops = _ops_for(kv_cache)
    (ops.reshape_and_cache if ops else reference.reshape_and_cache_ref)(
        key, value, kv_cache, slot_mapping
    )


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy whole blocks (K and V) for each (src, dst) row of block_mapping, in every layer."""
    ops = _ops_for(kv_caches[0]) if kv_caches else None
    (ops.copy_blocks if ops else reference.copy_blocks_ref)(kv_caches, block_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed prefill + decode batch -> [num_tokens, heads, head].

    Sequence s's query token j (of q_len) sits at position seq_lens[s] - q_len + j and sees the
    positions <= its own (and > pos - sliding_window); softcap c maps logits to c*tanh(x/c).
    Both paths check their inputs with metadata.check_attention, so they refuse the same ones.
    """
    if _cpu_attention(query):
        return paged_attention_cpu(query, kv_cache, meta, out=out)
    ops = _ops_for(query)
    if ops is None:
        return reference.paged_attention_ref(query, kv_cache, meta, out=out)
    out = torch.empty_like(query) if out is None else out
    check_attention(query, kv_cache, meta, out)  # before choosing a kernel from the shapes
    num_splits = decode_splits(query, kv_cache, meta)
    if num_splits > 1:
        return ops.decode_split_kv(query, kv_cache, meta, num_splits, out=out)
    return ops.paged_attention(query, kv_cache, meta, out=out)
