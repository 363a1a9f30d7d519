"""``SamplingParams``: how one generate request is sampled, the record a generate message
carries (shared/generate.py, PROTOCOL.md section 12) and the worker's sampler reads
(worker/sampler.py). Every field is checked here, once, for every path that builds one: the
generate socket, the front door, the offline ``LLM``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MAX_TOKENS = (1 << 31) - 1
MAX_PRIORITY = 1 << 31
MAX_SEED = (1 << 63) - 1
MAX_N = 64
MAX_TEMPERATURE = 1e4
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_STOP_IDS = 256
MAX_REPETITION_PENALTY = 1e4
# As vLLM 0.33's SamplingParams.__post_init__ (vllm/sampling_params.py): a temperature in
# (0, MIN_TEMPERATURE) is first raised to MIN_TEMPERATURE, then one below SAMPLING_EPS (so only
# 0) is greedy. A temperature of 1e-6 therefore samples, at 0.01, as in vLLM.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
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
    repetition_penalty: float = 1.0  # 1: off; logits of prompt and output tokens divided (> 0) or multiplied
    min_p: float = 0.0  # 0: off; drop tokens below min_p times the top token's probability
    # vLLM's request priority (lower is more important): the node tier keeps the blocks of the more
    # important requests longer (manager/core/node_level.py); the worker schedules FCFS regardless
    priority: int = 0
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
        if 0.0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
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
        rep = _finite(self.repetition_penalty, "repetition_penalty")
        if not 0.0 < rep <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), got {rep}")
        object.__setattr__(self, "repetition_penalty", rep)
        min_p = _finite(self.min_p, "min_p")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        object.__setattr__(self, "min_p", min_p)
        if type(self.priority) is not int or not -MAX_PRIORITY <= self.priority < MAX_PRIORITY:
            raise ValueError(f"priority must be an int in [-2**31, 2**31), got {_short(self.priority)}")
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
        """Greedy as vLLM decides it: a temperature below SAMPLING_EPS (top-k, top-p, min_p unused)."""
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Penalties that read the sample's output tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _short(value: object) -> str:
    """A bounded repr of a client's value (no recursion into deep nesting, at most 60 chars)."""
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{value!r:.60}"


def _finite(value: object, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    return float(value)
