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
from torch import nn

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
    """Keeps rank ``rank``'s share of every layer of ``model`` (in place) and sums o_proj's and
    down_proj's partial outputs with ``reduce`` (tests pass an in-process one); returns the
    model. ``size == 1`` leaves it whole."""
    check_tp(model.config, size)
    if size == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep_rows(proj, rank, size)
        for proj in (attn.o_proj, mlp.down_proj):
            _keep_columns(proj, rank, size)
        attn.num_heads //= size
        attn.num_kv_heads //= size
        attn.reduce = mlp.reduce = reduce
    model.tp_rank, model.tp_size = rank, size
    return model


def _own(t: torch.Tensor) -> nn.Parameter:
    """A contiguous copy: a slice would keep the whole tensor's storage alive."""
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=False)


@torch.no_grad()
def _keep_rows(linear: nn.Linear, rank: int, size: int) -> None:
    # weight: [out, in] -> [out / size, in]; the bias follows the rows
    share = linear.out_features // size
    rows = slice(rank * share, (rank + 1) * share)
    linear.weight = _own(linear.weight[rows])
    if linear.bias is not None:
        linear.bias = _own(linear.bias[rows])
    linear.out_features = share


@torch.no_grad()
def _keep_columns(linear: nn.Linear, rank: int, size: int) -> None:
    # weight: [out, in] -> [out, in / size]; row-parallel layers have no bias (it would be summed size times)
    assert linear.bias is None, "a row-parallel projection with a bias is not supported"
    share = linear.in_features // size
    linear.weight = _own(linear.weight[:, rank * share : (rank + 1) * share])
    linear.in_features = share
