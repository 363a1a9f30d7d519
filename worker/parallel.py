"""Tensor parallelism: the process group, sharding a model across ranks, the all-reduce.

One model replica over ``tp_size`` ranks (Megatron-style): q/k/v and gate/up are column-parallel
(each rank keeps its rows: its query heads, its KV heads, its slice of the MLP), o_proj and
down_proj are row-parallel (each rank keeps the matching input columns) and their partial
outputs are summed by an all-reduce. Embeddings, norms and the LM head are replicated. Query
head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``; contiguous shares keep each
rank's query heads next to their KV heads. Every rank builds the same seeded model (or loads
the same checkpoint) and keeps its share, so every rank's weights are a slice of one model.

torch.distributed carries it: gloo on CPU, nccl on CUDA; ``tp_size == 1`` creates no group.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpool.worker.config import check_tp
from kvpool.worker.model import LlamaForCausalLM, ReduceFn

logger = logging.getLogger(__name__)


class TPPeerLost(RuntimeError):
    """A tensor-parallel rank died or stopped answering: this replica cannot run another step."""


def init_group(rank: int, size: int, master: str, device: torch.device, timeout_s: float) -> None:
    """Joins the replica's process group at ``master`` ("host:port", rank 0 listens there).
    ``timeout_s`` bounds every collective: a rank silent that long is taken for dead."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logger.info("tensor-parallel rank %d of %d joining %s (%s)", rank, size, master, backend)
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """In-place sum of ``x`` over the replica's ranks (the row-parallel reduction)."""
    try:
        dist.all_reduce(x)
    except RuntimeError as e:  # gloo/nccl: a peer closed its connection or timed out
        raise TPPeerLost(f"all-reduce failed, a tensor-parallel rank is gone: {e}") from e
    return x


def shard_model(model: LlamaForCausalLM, rank: int, size: int, reduce: ReduceFn = all_reduce) -> LlamaForCausalLM:
    """Keeps rank ``rank``'s share of every layer of ``model`` (in place: ``model.shard``, the
    shares cut by worker/model.py's ``row_share``/``column_share``) and sums o_proj's and
    down_proj's partial outputs with ``reduce`` (tests pass an in-process one); returns the
    model. ``size == 1`` leaves it whole."""
    check_tp(model.config, size)
    if size > 1:
        model.shard(rank, size, reduce)
    return model
