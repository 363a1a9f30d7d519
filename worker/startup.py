"""Start-up of a worker: device, model, memory profile, registration, KV tensors, engine."""

from __future__ import annotations

import logging

import torch

from kvpool.worker.block_manager import BlockManager
from kvpool.worker.checkpoint import load_model
from kvpool.worker.config import WorkerConfig
from kvpool.worker.engine import Engine
from kvpool.worker.kv_cache import allocate_kv_caches
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.profiler import (
    activation_estimate,
    kv_cache_budget,
    profile_cpu,
    profile_cuda,
)
from kvpool.worker.runner import ModelRunner
from kvpool.worker.scheduler import Scheduler, SeqPlan, StepPlan

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def dummy_forward(model: LlamaForCausalLM, num_tokens: int, max_model_len: int, block_size: int) -> None:
    """A forward over ``num_tokens`` prompt tokens in sequences of at most max_model_len, every
    sequence sampling: the activation peak of the largest step the scheduler may plan."""
    cfg = model.config
    lens = [max_model_len - 1] * (num_tokens // (max_model_len - 1))
    if num_tokens % (max_model_len - 1):
        lens.append(num_tokens % (max_model_len - 1))
    plan, next_block = StepPlan(), 1
    for n in lens:
        nb = -(-n // block_size)
        plan.seqs.append(SeqPlan([0] * n, 0, list(range(next_block, next_block + nb)), True))
        next_block += nb
    p = next(model.parameters())
    caches = allocate_kv_caches(cfg.num_layers, next_block, block_size, cfg.num_kv_heads,
                                cfg.head_size, p.dtype, p.device)
    ModelRunner(model, caches, block_size).execute(plan)


def measure_kv_bytes(cfg: WorkerConfig, device: torch.device, dtype: torch.dtype):
    """Loads the model and returns (model, bytes the KV cache may take)."""
    holder: list[LlamaForCausalLM] = []

    def load() -> None:
        holder.append(load_model(cfg.model, dtype, device, cfg.seed))

    def forward() -> None:
        dummy_forward(holder[0], cfg.max_num_batched_tokens, cfg.max_model_len, cfg.block_size)

    if cfg.kv_cache_memory is not None:
        load()
        return holder[0], cfg.kv_cache_memory
    if device.type == "cuda":
        profile = profile_cuda(load, forward, device)
    else:
        load()
        m = holder[0].config
        floor = activation_estimate(cfg.max_num_batched_tokens, m.hidden_size, m.intermediate_size,
                                    m.num_heads, m.head_size, m.vocab_size, dtype.itemsize)
        profile = profile_cpu(holder[0], forward, cfg.cpu_memory_budget, floor)
    logger.info("memory profile: %s", profile)
    return holder[0], kv_cache_budget(profile, cfg.memory_utilization)


def build_engine(cfg: WorkerConfig, block_manager: BlockManager) -> Engine:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model, kv_bytes = measure_kv_bytes(cfg, device, dtype)
    if cfg.max_model_len > model.config.max_position:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                         f"max_position {model.config.max_position}; lower max_model_len")
    sched = Scheduler(cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                      enable_prefix_caching=cfg.enable_prefix_caching,
                      enable_chunked_prefill=cfg.enable_chunked_prefill,
                      static_prealloc=cfg.static_prealloc)
    return Engine(model, block_manager, sched, kv_bytes, seed=cfg.seed)
