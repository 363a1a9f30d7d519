"""The reference request trace that the benchmarks share (seeded, parameterised).

Defaults (the "reference trace"): 100,000 requests; prompt lengths uniform in [64, 512] tokens;
token ids uniform in [0, 32000); 30% of requests start with one of 32 shared 128-token prefixes;
block_size 16; 16,384 blocks; at most 64 requests alive.

Requests (bench/workload.py's ``TraceRequest``) are produced lazily, one at a time, so a
100k-request trace costs no memory; ``prompts`` renders their token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvpool.bench.workload import TraceRequest


@dataclass(frozen=True)
class TraceConfig:
    num_requests: int = 100_000
    min_prompt: int = 64
    max_prompt: int = 512
    vocab_size: int = 32_000
    shared_fraction: float = 0.30
    num_shared_prefixes: int = 32
    shared_prefix_len: int = 128
    block_size: int = 16
    num_blocks: int = 16_384
    max_alive: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError(f"need 1 <= min_prompt <= max_prompt, got {self.min_prompt}, {self.max_prompt}")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError(f"shared_fraction must be in [0, 1], got {self.shared_fraction}")
        if self.num_requests < 0 or self.max_alive < 1 or self.num_blocks < 2:
            raise ValueError("need num_requests >= 0, max_alive >= 1, num_blocks >= 2")


def reference_trace(cfg: TraceConfig) -> Iterator[TraceRequest]:
    """Yields each request (bench/workload.py's record), in arrival order."""
    rng = np.random.default_rng(cfg.seed)
    vocab = cfg.vocab_size
    prefixes = [
        rng.integers(0, vocab, cfg.shared_prefix_len).tolist() for _ in range(cfg.num_shared_prefixes)
    ]
    lengths = rng.integers(cfg.min_prompt, cfg.max_prompt + 1, cfg.num_requests).tolist()
    shared = (rng.random(cfg.num_requests) < cfg.shared_fraction).tolist()
    which = rng.integers(0, max(1, len(prefixes)), cfg.num_requests).tolist()
    for rid, (length, is_shared, k) in enumerate(zip(lengths, shared, which)):
        if prefixes and is_shared:
            head = prefixes[k][:length]  # a short prompt is a truncated shared prefix
            tokens = head + rng.integers(0, vocab, length - len(head)).tolist()
            yield TraceRequest(rid, 0, tuple(tokens), prefix_len=len(head), group=k)
        else:
            yield TraceRequest(rid, 0, tuple(rng.integers(0, vocab, length).tolist()))


def prompts(cfg: TraceConfig) -> Iterator[list[int]]:
    """Each request's prompt token ids, in arrival order: what the pool benchmarks hash."""
    for req in reference_trace(cfg):
        yield list(req.prompt)
