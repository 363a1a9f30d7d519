"""Copy whole cache blocks (K and V) in every layer: copy-on-write for forked requests.

One launch covers all layers: the layers' base addresses travel in an int64 pointer table, so a
fork costs one kernel launch, not one per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_copy_blocks
from .metadata import AttentionInputError


@triton.jit
def _copy_blocks_kernel(
    layer_ptrs,  # [num_layers] int64 base addresses of each layer's kv_cache
    mapping_ptr,  # [num_pairs, 2] int64 (src, dst)
    stride_kv,
    stride_blk,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_size
    CHUNK: tl.constexpr,
    ELEM: tl.constexpr,  # dtype of the caches
):
    layer = tl.program_id(0)
    pair = tl.program_id(1)
    kv = tl.program_id(2).to(tl.int64)
    base = tl.load(layer_ptrs + layer).to(tl.pointer_type(ELEM))
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    src_ptr = base + kv * stride_kv + src * stride_blk
    dst_ptr = base + kv * stride_kv + dst * stride_blk
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


_TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """kv_cache[:, dst] = kv_cache[:, src] for every (src, dst) row, in every layer.

    Destinations must be distinct and must not be sources in the same call (copy-on-write always
    copies into freshly allocated blocks); programs run concurrently, so order is not defined.
    """
    check_copy_blocks(kv_caches, block_mapping)
    first = kv_caches[0]
    if not first[0, 0].is_contiguous() or first.dtype not in _TORCH_TO_TL:
        raise AttentionInputError(
            f"copy_blocks needs contiguous cache blocks of fp16, bf16 or fp32, got {first.dtype}"
        )
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    mapping = block_mapping.to(first.device).contiguous()
    layer_ptrs = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=first.device)
    block_numel = first[0, 0].numel()
    _copy_blocks_kernel[(len(kv_caches), num_pairs, 2)](
        layer_ptrs, mapping, first.stride(0), first.stride(1),
        BLOCK_NUMEL=block_numel,
        CHUNK=min(triton.next_power_of_2(block_numel), 4096),
        ELEM=_TORCH_TO_TL[first.dtype],
    )
