"""The host tier's KV tensors on the worker and the copies the manager orders.

A host cache mirrors the device cache's per-layer layout ``[2, blocks, block_size, heads,
head_size]`` with the host tier's block count, in host memory (pinned on CUDA so copies run
asynchronously). Each step's ``saves`` (device -> host) run before its ``loads`` (host ->
device), both before the step's copy-on-write copies and forward pass (worker/runner.py), one
batched call per direction: the manager's ordering rules (manager/core/host_tier.py) assume it.
"""

from __future__ import annotations

import torch


def allocate_host_caches(device_caches: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Host tensors of ``num_blocks`` blocks shaped like ``device_caches`` (this shard's slice)."""
    pin = device_caches[0].device.type == "cuda"
    return [torch.zeros((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin)
            for c in device_caches]


def host_bytes(host_caches: list[torch.Tensor]) -> int:
    return sum(c.numel() * c.element_size() for c in host_caches)


def copy_blocks_across(src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """For every layer, block ``s`` of ``src`` into block ``d`` of ``dst`` for each pair; the
    source blocks are gathered once per layer, so the copy is one transfer per layer."""
    if not pairs:
        return
    src_idx = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src[0].device)
    dst_idx = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst[0].device)
    non_blocking = src[0].device.type != dst[0].device.type
    for s, d in zip(src, dst):
        d.index_copy_(1, dst_idx, s.index_select(1, src_idx).to(d.device, non_blocking=non_blocking))
    if non_blocking and dst[0].device.type == "cpu":
        torch.cuda.synchronize()  # a device -> host copy must land before a load reads it
