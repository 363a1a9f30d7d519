"""Token sampling: greedy, temperature, top-p; seeded and independent of batching.

The random draw of a request's k-th output token of sample ``index`` depends only on
``(seed, index, k)``, so a request gives the same tokens whatever it was batched with, and after
preemption and recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = (1 << 61) - 1  # a Mersenne prime: mixes (seed, index, step) into a generator seed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: drawn from the engine's seed at submission
    n: int = 1  # parallel samples sharing the prompt's blocks (fork, copy-on-write)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.n <= 64:
            raise ValueError(f"n must be in [1, 64], got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SampleKey:
    """Which draw a row is: its params, seed, sample index and output position."""

    params: SamplingParams
    seed: int
    index: int
    step: int


def _draw_seed(key: SampleKey) -> int:
    return (key.seed * 1_000_003 + key.index * 7919 + key.step) % _MIX


def _sample_row(logits: torch.Tensor, key: SampleKey) -> int:
    # logits: [vocab] fp32
    probs = torch.softmax(logits / key.params.temperature, dim=-1)
    if key.params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_p.cumsum(0) - sorted_p >= key.params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    gen = torch.Generator(device=logits.device).manual_seed(_draw_seed(key))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / noise).argmax())  # exponential race == sampling from probs


def sample(logits: torch.Tensor, keys: list[SampleKey]) -> list[int]:
    """One token per row of ``logits`` [rows, vocab] (fp32)."""
    out = logits.argmax(-1).tolist()
    for row, key in enumerate(keys):
        if not key.params.greedy:
            out[row] = _sample_row(logits[row], key)
    return out
