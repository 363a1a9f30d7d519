"""The worker's KV tensors: allocated once, from the num_blocks the manager returned.

Per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (0 = K, 1 = V). Block 0 is
the null block that block tables pad with; it is allocated like the others but never written.
"""

from __future__ import annotations

import torch

from kvpool.shared.protocol import KVSpec
from kvpool.worker.config import ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kv_spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVSpec:
    """The spec a shard registers with (num_kv_heads: this shard's, of ``tp_size`` shards)."""
    return KVSpec(block_size, cfg.num_layers, cfg.num_kv_heads // tp_size, cfg.head_size, DTYPE_NAMES[dtype])


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
    dtype: torch.dtype, device: torch.device | str,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    # zeros, not empty: masked slots of a partial block are still multiplied by a zero weight,
    # and 0 * NaN garbage would poison the sum
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
