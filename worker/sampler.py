"""Token sampling: greedy, temperature, top-p; seeded and independent of batching.

The random draw of a request's k-th output token of sample ``index`` depends only on
``(seed, index, k)``, so a request gives the same tokens whatever it was batched with, and after
preemption and recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

_MIX = (1 << 61) - 1  # a Mersenne prime: mixes (seed, index, step) into a generator seed
MAX_TOKENS = (1 << 31) - 1
MAX_SEED = (1 << 63) - 1
MAX_N = 64
MAX_TEMPERATURE = 1e4


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: drawn from the engine's seed at submission
    n: int = 1  # parallel samples sharing the prompt's blocks (fork, copy-on-write)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """Every field's type and range (bools are not ints, ints are not floats here: a client
        of the generate socket may send anything, and the sampler and the scheduler trust this)."""
        if type(self.max_tokens) is not int or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be an int in [1, {MAX_TOKENS}], got {_short(self.max_tokens)}")
        if type(self.n) is not int or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {_short(self.n)}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an int in [0, 2**63 - 1] or absent, got {_short(self.seed)}")
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"ignore_eos must be a bool, got {_short(self.ignore_eos)}")
        temperature = _finite(self.temperature, "temperature")
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {temperature}")
        top_p = _finite(self.top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)

    @classmethod
    def from_wire(cls, raw: object) -> SamplingParams:
        """The params map of a generate message; unknown keys are refused (not ignored)."""
        if raw is None:
            return cls()
        if type(raw) is not dict:
            raise ValueError(f"params must be a map, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in raw if k not in known]
        if unknown:
            raise ValueError(f"unknown params {sorted(map(str, unknown))[:8]!r:.120}; known: {', '.join(known)}")
        return cls(**raw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _short(value: object) -> str:
    """A bounded repr of a client's value (no recursion into deep nesting, at most 60 chars)."""
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{value!r:.60}"


def _finite(value: object, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    return float(value)


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
