"""The simulated workload: its config, the seeded trace (kvpool.bench's ``TraceRequest`` records) and
the record of a running sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpool.bench.workload import TraceRequest
from kvpool.shared.hashing import SEED
from kvpool.shared.protocol import HOST_POLICIES

LLAMA3_8B_KV_BYTES = 2 * 32 * 8 * 128 * 2  # K and V * layers * kv heads * head size * bf16


@dataclass(frozen=True)
class SimConfig:
    num_requests: int = 2000
    max_model_len: int = 4096
    budget_tokens: int = 65536  # 8 GiB of Llama-3-8B KV
    block_size: int = 16
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES
    prompt_median: float = 128.0  # user part; lognormal, ShareGPT-like means
    prompt_sigma: float = 1.0
    output_median: float = 160.0
    output_sigma: float = 1.0
    system_share: float = 0.4
    num_system_prompts: int = 8
    system_min: int = 256
    system_max: int = 1024
    parallel_share: float = 0.2  # disjoint from the system-prompt share
    parallel_n: int = 4
    arrival_rate: float = 1.0  # Poisson arrivals, requests per step; 0: all at step 0
    watermark: float = 0.01
    host_budget_x: float = 4.0  # paged+host: host tier blocks per device block (32 GiB of host RAM at the default)
    host_policy: str = "demote"  # paged+host: or "write_through" (manager/core/host_tier.py)
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget_tokens < self.parallel_n * self.max_model_len:
            raise ValueError(f"budget_tokens {self.budget_tokens} cannot hold one n={self.parallel_n} request "
                             f"at max_model_len {self.max_model_len}: raise --budget-tokens")
        if self.budget_tokens % self.block_size:
            raise ValueError(f"budget_tokens {self.budget_tokens} is not a multiple of block_size {self.block_size}")
        if self.system_share + self.parallel_share > 1 or min(self.system_share, self.parallel_share) < 0:
            raise ValueError("need shares >= 0 with system_share + parallel_share <= 1")
        if not 1 <= self.system_min <= self.system_max < self.max_model_len // 2:
            raise ValueError("need 1 <= system_min <= system_max < max_model_len / 2")
        if self.num_requests < 1 or self.parallel_n < 1 or not 0 <= self.watermark < 0.5:
            raise ValueError("need num_requests >= 1, parallel_n >= 1, 0 <= watermark < 0.5")
        if self.host_budget_x < 0:
            raise ValueError(f"host_budget_x must be >= 0 (host tier blocks per device block), got {self.host_budget_x}")
        if self.host_policy not in HOST_POLICIES:
            raise ValueError(f"host_policy must be one of {HOST_POLICIES}, got {self.host_policy!r}")
        if self.arrival_rate < 0:
            raise ValueError(f"arrival_rate must be >= 0 (0: all at step 0), got {self.arrival_rate}")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int) -> np.ndarray:
    return np.rint(rng.lognormal(math.log(median), sigma, size)).astype(np.int64)


def make_trace(cfg: SimConfig) -> list[TraceRequest]:
    """The seeded trace as kvpool.bench's records: arrivals in steps, one output length per
    parallel sample, a system prompt as the shared prefix of its group."""
    rng = np.random.default_rng(cfg.seed)
    systems = [rng.integers(0, cfg.vocab_size, rng.integers(cfg.system_min, cfg.system_max + 1)).tolist()
               for _ in range(cfg.num_system_prompts)]
    kind = rng.random(cfg.num_requests)
    gaps = rng.exponential(1 / cfg.arrival_rate, cfg.num_requests) if cfg.arrival_rate else np.zeros(cfg.num_requests)
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    user = np.clip(_lognormal(rng, cfg.prompt_median, cfg.prompt_sigma, cfg.num_requests), 1, cfg.max_model_len // 2)
    trace = []
    for rid in range(cfg.num_requests):
        group = int(rng.integers(len(systems))) if kind[rid] < cfg.system_share else None
        head = systems[group] if group is not None else []
        prompt = (head + rng.integers(0, cfg.vocab_size, user[rid]).tolist())[: cfg.max_model_len - 1]
        n = cfg.parallel_n if cfg.system_share <= kind[rid] < cfg.system_share + cfg.parallel_share else 1
        outs = np.clip(_lognormal(rng, cfg.output_median, cfg.output_sigma, n), 1, cfg.max_model_len - len(prompt))
        trace.append(TraceRequest(rid, int(arrival[rid]), tuple(prompt), tuple(int(o) for o in outs),
                                  min(len(head), len(prompt)), group))
    return trace


class Seq:
    """The one mutable record of a running sequence (one parallel sample of a request)."""

    __slots__ = ("req", "idx", "uid", "out_len", "num_tokens", "generated", "start", "cap", "last_hash")

    def __init__(self, req: TraceRequest, idx: int, n_max: int) -> None:
        assert idx < n_max, f"request {req.rid} has more samples than parallel_n {n_max}"
        self.req, self.idx, self.uid = req, idx, req.rid * n_max + idx
        self.out_len = req.out_lens[idx]
        self.num_tokens = self.generated = 0  # KV slots written; decode tokens written
        self.start = self.cap = 0  # contiguous strategies: region [start, start + cap)
        self.last_hash = SEED  # paged+prefix: hash of the last full block

    def token(self, pos: int) -> int:
        """Token id at ``pos``: the prompt, then a deterministic stand-in for sampled tokens."""
        p = self.req.prompt
        return p[pos] if pos < len(p) else (self.uid * 1_000_003 + pos * 7919) % 32000



def trace_stats(trace: list[TraceRequest]) -> dict:
    prompts = np.array([len(r.prompt) for r in trace])
    outs = np.array([o for r in trace for o in r.out_lens])
    return {
        "requests": len(trace),
        "sequences": len(outs),
        "parallel_requests": sum(len(r.out_lens) > 1 for r in trace),
        "prompt_mean": float(prompts.mean()), "prompt_p50": float(np.median(prompts)),
        "prompt_p99": float(np.percentile(prompts, 99)), "prompt_max": int(prompts.max()),
        "output_mean": float(outs.mean()), "output_p50": float(np.median(outs)),
        "output_p99": float(np.percentile(outs, 99)), "output_max": int(outs.max()),
        "output_tokens": int(outs.sum()),
    }
