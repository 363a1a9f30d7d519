"""Start-up of a worker: device, model, memory profile, registration, KV tensors, engine.

A tensor-parallel rank (``tp_size > 1``, process group already joined: worker/parallel.py)
builds the whole model, keeps its share and profiles its own memory; rank 0 gets the engine,
the others a ``TPFollower`` (worker/tp.py). ``serve_rank`` wires it all for ``kvpool worker``.
"""

from __future__ import annotations

import gc
import logging

import torch

from kvpool.shared.summaries import ServeInfo
from kvpool.worker.block_manager import BlockManager, RemoteBlockManager
from kvpool.worker.checkpoint import load_config, load_model
from kvpool.worker.config import WorkerConfig, model_identity, with_model_len
from kvpool.worker.cpu_linear import pack_linears
from kvpool.worker.endpoint import claim
from kvpool.worker.engine import Engine
from kvpool.worker.host_memory import check_kv_request
from kvpool.worker.metrics import WorkerMetrics
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.parallel import check_tp, close_group, init_group, shard_model
from kvpool.worker.profiler import (
    activation_estimate,
    kv_cache_budget,
    profile_cpu,
    profile_cuda,
)
from kvpool.worker.runner import allocate_runner
from kvpool.worker.scheduler import Batch, BatchSeq, Scheduler
from kvpool.worker.server import WorkerServer
from kvpool.worker.tp import Channel, TPFollower, TPLeader

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rank_device(cfg: WorkerConfig) -> torch.device:
    """This rank's device: the ranks of one replica take one GPU each (cuda:tp_rank)."""
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None and cfg.tp_size > 1:
        return torch.device("cuda", cfg.tp_rank)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def dummy_forward(model: LlamaForCausalLM, num_tokens: int, max_model_len: int, block_size: int) -> None:
    """A forward over ``num_tokens`` prompt tokens in sequences of at most max_model_len, every
    sequence sampling: the activation peak of the largest step the scheduler may plan."""
    lens = [max_model_len - 1] * (num_tokens // (max_model_len - 1))
    if num_tokens % (max_model_len - 1):
        lens.append(num_tokens % (max_model_len - 1))
    plan, next_block = Batch(), 1
    for n in lens:
        nb = -(-n // block_size)
        plan.seqs.append(BatchSeq([0] * n, 0, list(range(next_block, next_block + nb)), True))
        next_block += nb
    allocate_runner(model, next_block, block_size).execute(plan)


def measure_kv_bytes(cfg: WorkerConfig, device: torch.device, dtype: torch.dtype):
    """Loads the model (this rank's share of it) and returns (model, bytes the KV cache may take)."""
    holder: list[LlamaForCausalLM] = []

    def load() -> None:
        holder.append(shard_model(load_model(cfg.model, dtype, device, cfg.seed), cfg.tp_rank, cfg.tp_size))

    def forward() -> None:
        dummy_forward(holder[0], cfg.max_num_batched_tokens, cfg.max_model_len, cfg.block_size)

    host = host_kv_share(cfg)
    if cfg.kv_cache_memory is not None:
        load()
        check_kv_request(cfg.kv_cache_memory, device, "--kv-cache-memory (kv_cache_memory)")
        check_host_request(host, cfg.kv_cache_memory, device)
        return holder[0], cfg.kv_cache_memory
    if device.type == "cuda":
        profile = profile_cuda(load, forward, device)
    else:
        load()
        m = holder[0].config
        tp = cfg.tp_size
        floor = activation_estimate(cfg.max_num_batched_tokens, m.hidden_size, m.intermediate_size // tp,
                                    m.num_heads // tp, m.head_size, m.vocab_size, dtype.itemsize)
        if host >= cfg.cpu_memory_budget:
            raise ValueError(f"--host-kv-memory ({host} bytes per rank) leaves nothing of --cpu-memory-budget "
                             f"({cfg.cpu_memory_budget} bytes) for the model and the device KV: lower it or raise the budget")
        profile = profile_cpu(holder[0], forward, cfg.cpu_memory_budget - host, floor)  # the host tier's share out
    logger.info("memory profile: %s", profile)
    kv_bytes = kv_cache_budget(profile, cfg.memory_utilization)
    setting = "--memory-utilization" if device.type == "cuda" else "--cpu-memory-budget (cpu_memory_budget)"
    check_kv_request(kv_bytes, device, setting)
    check_host_request(host, kv_bytes, device)
    return holder[0], kv_bytes


def check_host_request(host: int, kv_bytes: int, device: torch.device) -> None:
    """The host tier (with the device KV too when the device is the CPU) must fit host memory."""
    if host:
        check_kv_request(host + (kv_bytes if device.type == "cpu" else 0), torch.device("cpu"),
                         "--host-kv-memory (host_kv_memory)")


def load_rank(cfg: WorkerConfig) -> tuple[LlamaForCausalLM, int]:
    """This rank's model share on its device, and the KV bytes it may take."""
    cfg = with_model_len(cfg, load_config(cfg.model))
    device = rank_device(cfg)
    model, kv_bytes = measure_kv_bytes(cfg, device, resolve_dtype(cfg.dtype, device))
    if cfg.max_model_len > model.config.max_position:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                         f"max_position {model.config.max_position}; lower max_model_len")
    if cfg.packed_weights:
        pack_linears(model)  # after profiling and sharding: the packed weights replace the dense ones
    return model, kv_bytes


def host_kv_share(cfg: WorkerConfig) -> int:
    """This rank's share of ``--host-kv-memory`` (each shard keeps its slice of every host block)."""
    return cfg.host_kv_memory // cfg.tp_size


def build_engine(cfg: WorkerConfig, block_manager: BlockManager) -> Engine:
    """The engine of a single worker, or of tensor-parallel rank 0 (which registers every shard)."""
    if cfg.tp_rank != 0:
        raise ValueError(f"tensor-parallel rank {cfg.tp_rank} follows rank 0: use build_follower")
    cfg = with_model_len(cfg, load_config(cfg.model))
    model, kv_bytes = load_rank(cfg)
    sched = Scheduler(cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                      enable_prefix_caching=cfg.enable_prefix_caching,
                      enable_chunked_prefill=cfg.enable_chunked_prefill,
                      static_prealloc=cfg.static_prealloc, eos_token_ids=model.config.eos_token_ids)
    tp = TPLeader(Channel(rank_device(cfg)), cfg.tp_size) if cfg.tp_size > 1 else None
    node_model = model_identity(cfg.model, cfg.seed) if cfg.node_tier else None
    return Engine(model, block_manager, sched, kv_bytes, seed=cfg.seed, tp=tp, overlap=cfg.overlap,
                  host_kv_bytes=host_kv_share(cfg), host_kv_policy=cfg.host_kv_policy, node_model=node_model,
                  node_read_timeout_s=cfg.node_tier_read_timeout)


def build_follower(cfg: WorkerConfig, block_manager: BlockManager) -> TPFollower:
    """Tensor-parallel rank ``cfg.tp_rank > 0``: registers when rank 0 says so (``run``)."""
    if cfg.tp_rank == 0:
        raise ValueError("rank 0 runs the scheduler: use build_engine")
    cfg = with_model_len(cfg, load_config(cfg.model))
    model, kv_bytes = load_rank(cfg)
    return TPFollower(model, block_manager, Channel(rank_device(cfg)), block_size=cfg.block_size,
                      available_kv_bytes=kv_bytes, max_model_len=cfg.max_model_len,
                      host_kv_bytes=host_kv_share(cfg), host_kv_policy=cfg.host_kv_policy,
                      node_model=model_identity(cfg.model, cfg.seed) if cfg.node_tier else None,
                      node_read_timeout_s=cfg.node_tier_read_timeout)


def serve_rank(cfg: WorkerConfig, manager_eps: list[str], endpoint: str, tp_master: str, tp_timeout: float,
               replace: bool = False) -> None:
    """One worker, or one tensor-parallel rank: joins the group, loads its share, serves (rank 0)
    or follows. Raises ValueError or KVMemoryError (config or memory: the message says what to
    change; EndpointInUse: another live worker serves the endpoint), ManagerError (the manager
    refused or is gone), TPPeerLost (another rank is gone). ``replace``: take the pool over from
    a live worker (`kvpool worker --replace`)."""
    try:
        shape = load_config(cfg.model)
        cfg = with_model_len(cfg, shape)  # a max_model_len the model cannot take is refused before it loads
        if cfg.tp_size > 1:  # refuse a bad split before any rank waits for the others
            check_tp(shape, cfg.tp_size)
            init_group(cfg.tp_rank, cfg.tp_size, tp_master, rank_device(cfg), tp_timeout)
        if cfg.tp_rank == 0:  # before the model loads: a refusal comes at once
            # a stale socket: the previous worker here died; its session may not have expired yet
            replace = claim(endpoint, cfg.pool, replace) == "stale" or replace
        # the id clients ask for (vLLM's --served-model-name); the checkpoint names the tokenizer
        named = cfg.served_model_name is not None and cfg.served_model_name != cfg.model
        serve = ServeInfo(endpoint, cfg.served_model_name or cfg.model, cfg.max_model_len,
                          tokenizer=cfg.model if named else None).to_wire()
        bm = RemoteBlockManager(manager_eps, cfg.pool, shard_rank=cfg.tp_rank, shard_count=cfg.tp_size,
                                serve=serve if cfg.tp_rank == 0 else None,  # front doors find rank 0 by it
                                replace=replace, receiver_thread=cfg.overlap)
        if cfg.tp_rank == 0:
            engine = build_engine(cfg, bm)
            curve = (cfg.curve_secret_key_file, cfg.curve_allowed_keys_dir) if cfg.curve_secret_key_file else None
            server = WorkerServer(engine, endpoint, cfg.pool, metrics=WorkerMetrics.start(cfg), curve=curve)
            freeze_start_up_heap()
            server.serve()
        else:
            follower = build_follower(cfg, bm)
            freeze_start_up_heap()
            follower.run()
    finally:
        close_group()


def freeze_start_up_heap() -> int:
    """Collects once, then moves every object alive now (torch and the other imports, the model,
    the engine, the sockets) out of the garbage collector's sight (``gc.freeze``); returns how
    many. They live as long as the process, and a full collection walks every tracked object:
    ~170k once torch is imported, about 0.1 s on a loaded 2-core machine, a stall of whichever
    step it lands in. Frozen, the collections of the serving loop walk only what came since.
    Called once start-up is done, before the first request (vLLM's EngineCore does the same)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
