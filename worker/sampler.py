"""Token sampling: greedy, temperature, top-k, top-p, penalties, min_tokens; seeded and
independent of batching; optional log-probabilities.

The random draw of a request's k-th output token of sample ``index`` depends only on
``(seed, index, k)``, so a request gives the same tokens whatever it was batched with, and after
preemption and recompute.

Order of processing one row (as OpenAI and vLLM define the parameters): presence and frequency
penalties on the logits (``logit -= presence * [count > 0] + frequency * count`` over the
sample's output tokens), ``min_tokens`` bans the stop ids, then temperature, top-k, top-p.
Log-probabilities are of the model's raw distribution (log_softmax of the unprocessed logits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

_MIX = (1 << 61) - 1  # a Mersenne prime: mixes (seed, index, step) into a generator seed
MAX_TOKENS = (1 << 31) - 1
MAX_SEED = (1 << 63) - 1
MAX_N = 64
MAX_TEMPERATURE = 1e4
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_STOP_IDS = 256
TEXT_ONLY = ("stop",)  # applied to text by the front door and the offline LLM: not a wire param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: drawn from the engine's seed at submission
    n: int = 1  # parallel samples sharing the prompt's blocks (fork, copy-on-write)
    ignore_eos: bool = False
    top_k: int = 0  # 0: off
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # end the sample (finish reason "stop"), EOS aside
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k alternatives
    stop: tuple[str, ...] = ()  # stop strings: applied to text by the front door and the offline LLM

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
        self._check_openai_fields()

    def _check_openai_fields(self) -> None:
        if type(self.top_k) is not int or not 0 <= self.top_k <= MAX_TOKENS:
            raise ValueError(f"top_k must be an int >= 0 (0 is off), got {_short(self.top_k)}")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got "
                             f"{_short(self.min_tokens)}")
        for key in ("presence_penalty", "frequency_penalty"):
            value = _finite(getattr(self, key), key)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{key} must be in [-2, 2], got {value}")
            object.__setattr__(self, key, value)
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or absent, got {_short(self.logprobs)}")
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or len(ids) > MAX_STOP_IDS or \
                any(type(t) is not int or not 0 <= t <= MAX_TOKENS for t in ids):
            raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_IDS} token ids, got {_short(ids)}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", tuple(stop))

    @classmethod
    def from_wire(cls, raw: object) -> SamplingParams:
        """The params map of a generate message; unknown keys are refused (not ignored)."""
        if raw is None:
            return cls()
        if type(raw) is not dict:
            raise ValueError(f"params must be a map, got {type(raw).__name__}")
        known = [f.name for f in fields(cls) if f.name not in TEXT_ONLY]
        unknown = [k for k in raw if k not in known]
        if unknown:
            raise ValueError(f"unknown params {sorted(map(str, unknown))[:8]!r:.120}; known: {', '.join(known)}")
        return cls(**raw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
    """Which draw a row is: its params, seed, sample index and output position; the sample's
    output so far (needed by penalties only) and the ids banned at this position (min_tokens)."""

    params: SamplingParams
    seed: int
    index: int
    step: int
    output: Sequence[int] = ()
    banned: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # best first


def _draw_seed(key: SampleKey) -> int:
    return (key.seed * 1_000_003 + key.index * 7919 + key.step) % _MIX


def _process(logits: torch.Tensor, key: SampleKey) -> torch.Tensor:
    # logits: [vocab] fp32; returns a new tensor
    p = key.params
    logits = logits.clone()
    if p.penalized and key.output:
        counts = torch.bincount(torch.tensor(list(key.output), dtype=torch.long), minlength=logits.numel())
        counts = counts[: logits.numel()].to(logits.device, logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if key.banned:
        ids = [t for t in key.banned if t < logits.numel()]
        logits[ids] = float("-inf")
    return logits


def _sample_row(logits: torch.Tensor, key: SampleKey) -> int:
    # logits: [vocab] fp32, already penalized
    p = key.params
    if p.greedy:
        return int(logits.argmax())
    if 0 < p.top_k < logits.numel():
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    gen = torch.Generator(device=logits.device).manual_seed(_draw_seed(key))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / noise).argmax())  # exponential race == sampling from probs


def _simple(key: SampleKey) -> bool:
    p = key.params
    return p.greedy and not key.banned and not (p.penalized and key.output)


def sample_rows(logits: torch.Tensor, keys: list[SampleKey]) -> list[Sampled]:
    """One token per row of ``logits`` [rows, vocab] (fp32), with log-probs where asked."""
    out = logits.argmax(-1).tolist()
    for row, key in enumerate(keys):
        if not _simple(key):
            out[row] = _sample_row(_process(logits[row], key), key)
    result = []
    for row, (tok, key) in enumerate(zip(out, keys)):
        k = key.params.logprobs
        if k is None:
            result.append(Sampled(tok))
            continue
        lp = torch.log_softmax(logits[row].float(), dim=-1)
        top = lp.topk(k) if k else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        result.append(Sampled(tok, float(lp[tok]), pairs))
    return result


def sample(logits: torch.Tensor, keys: list[SampleKey]) -> list[int]:
    """One token per row of ``logits`` [rows, vocab] (fp32)."""
    return [s.token for s in sample_rows(logits, keys)]
