"""The one set of input checks that the Triton path and the torch reference both run.

Each op's Triton launch wrapper and its reference call the same function here first, so the two
paths accept and refuse the same inputs (dtypes, shapes, devices, head grouping, block ids).
Checks that read tensor contents run only on CPU tensors (on CUDA they would stall the stream).
"""

from __future__ import annotations

import torch

from .metadata import ATTENTION_DTYPES, AttentionInputError, AttentionMetadata


def check_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
) -> None:
    """Refuses attention inputs that any path would mis-handle (one rule for CPU and Triton)."""
    if not (query.dim() == 3):
        raise AttentionInputError(
            f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}"
        )
    num_tokens, num_heads, head_size = query.shape
    if not (kv_cache.dim() == 5 and kv_cache.shape[0] == 2):
        raise AttentionInputError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(kv_cache.shape)}"
        )
    num_kv_heads = kv_cache.shape[3]
    if not (kv_cache.shape[4] == head_size):
        raise AttentionInputError(
            f"kv_cache head_size {kv_cache.shape[4]} != query head_size {head_size}"
        )
    if not (num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        raise AttentionInputError(
            f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads: "
            f"each kv head must serve a whole group of query heads (GQA)"
        )
    if query.dtype not in ATTENTION_DTYPES:
        raise AttentionInputError(
            f"query dtype {query.dtype} unsupported; use one of {', '.join(map(str, ATTENTION_DTYPES))}"
        )
    if not (query.dtype == kv_cache.dtype):
        raise AttentionInputError(
            f"query {query.dtype} and kv_cache {kv_cache.dtype} differ: cast the query to the cache dtype"
        )
    if not (out.shape == query.shape and out.dtype == query.dtype):
        raise AttentionInputError(
            f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    for name, t in (("kv_cache", kv_cache), ("out", out), ("metadata", meta.seq_lens)):
        if not (t.device == query.device):
            raise AttentionInputError(
                f"{name} is on {t.device}, query on {query.device}"
            )
    if not (query.stride(2) == out.stride(2) == kv_cache.stride(4) == 1):
        raise AttentionInputError(
            "the head_size dimension of query, out and kv_cache must be contiguous"
        )
    if query.device.type == "cpu":
        _check_table(query, kv_cache, meta)


def _check_table(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    # Every block a sequence reads must be a block of this cache; padding past it is ignored.
    num_tokens = int(meta.query_start_loc[-1])
    if not (num_tokens == query.shape[0]):
        raise AttentionInputError(
            f"query has {query.shape[0]} tokens, query_start_loc says {num_tokens}"
        )
    block_size, num_blocks = kv_cache.shape[2], kv_cache.shape[1]
    if (num_blocks, block_size) in meta._tables_checked:
        return
    needed = (meta.seq_lens.to(torch.int64) + block_size - 1) // block_size
    if not (meta.num_seqs == 0 or int(needed.max()) <= meta.block_tables.shape[1]):
        raise AttentionInputError(
            f"block_tables has {meta.block_tables.shape[1]} columns; the longest sequence needs "
            f"{int(needed.max()) if meta.num_seqs else 0} blocks of {block_size}"
        )
    used = torch.arange(meta.block_tables.shape[1]) < needed[:, None]
    ids = meta.block_tables[used]
    if not (ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_blocks)):
        raise AttentionInputError(
            f"block_tables name blocks outside [0, {num_blocks}) within the sequences' lengths"
        )
    meta._tables_checked.add((num_blocks, block_size))


def check_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Refuses reshape_and_cache inputs (one rule for CPU and Triton)."""
    if not (key.dim() == 3 and key.shape == value.shape):
        raise AttentionInputError(
            f"key/value must be [num_tokens, num_kv_heads, head_size] and equal, got "
            f"{tuple(key.shape)} / {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_size = key.shape
    if not (kv_cache.dim() == 5 and kv_cache.shape[0] == 2):
        raise AttentionInputError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(kv_cache.shape)}"
        )
    if not (tuple(kv_cache.shape[3:]) == (num_kv_heads, head_size)):
        raise AttentionInputError(
            f"kv_cache heads/head_size {tuple(kv_cache.shape[3:])} != key's {(num_kv_heads, head_size)}"
        )
    if not (key.dtype == value.dtype == kv_cache.dtype):
        raise AttentionInputError(
            f"key/value/kv_cache dtypes differ: {key.dtype}, {value.dtype}, {kv_cache.dtype}; "
            f"cast key and value to the cache dtype"
        )
    if not (slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64):
        raise AttentionInputError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if not (key.device == value.device == kv_cache.device == slot_mapping.device):
        raise AttentionInputError(
            f"key, value, kv_cache and slot_mapping must share a device, got {key.device}, "
            f"{value.device}, {kv_cache.device}, {slot_mapping.device}"
        )
    if not (key.stride(2) == value.stride(2) == kv_cache.stride(4) == 1):
        raise AttentionInputError(
            "the head_size dimension of key, value and kv_cache must be contiguous"
        )
    if kv_cache.device.type == "cpu" and num_tokens:
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        if not (int(slot_mapping.min()) >= -1 and int(slot_mapping.max()) < num_slots):
            raise AttentionInputError(
                f"slot_mapping must hold -1 (skip) or slots in [0, {num_slots})"
            )


def check_copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Refuses copy_blocks inputs (one rule for CPU and Triton)."""
    if not (bool(kv_caches)):
        raise AttentionInputError(
            "kv_caches is empty: pass every layer's cache"
        )
    first = kv_caches[0]
    if not (first.dim() == 5 and first.shape[0] == 2):
        raise AttentionInputError(
            f"each kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(first.shape)}"
        )
    if not (all(c.shape == first.shape and c.stride() == first.stride() and c.dtype == first.dtype and c.device == first.device for c in kv_caches)):
        raise AttentionInputError(
            "all layers' kv_caches must share shape, strides, dtype and device"
        )
    if not (block_mapping.dim() == 2 and block_mapping.shape[1] == 2 and block_mapping.dtype == torch.int64):
        raise AttentionInputError(
            f"block_mapping must be int64 [n, 2] of (src, dst), got {block_mapping.dtype} {tuple(block_mapping.shape)}"
        )
    if block_mapping.device.type == "cpu" and block_mapping.numel():
        num_blocks = first.shape[1]
        if not (int(block_mapping.min()) >= 0 and int(block_mapping.max()) < num_blocks):
            raise AttentionInputError(
                f"block_mapping names blocks outside [0, {num_blocks})"
            )
        dst = block_mapping[:, 1].tolist()
        if not (len(set(dst)) == len(dst) and not set(dst) & set(block_mapping[:, 0].tolist())):
            raise AttentionInputError(
                "block_mapping destinations must be distinct and must not be sources of the same call"
            )
