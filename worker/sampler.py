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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# SamplingParams is the generate message's record (shared/sampling.py); imported from here too
from kvpool.shared.sampling import SamplingParams

__all__ = ["SampleKey", "Sampled", "SamplingParams", "sample", "sample_rows"]
_MIX = (1 << 61) - 1  # a Mersenne prime: mixes (seed, index, step) into a generator seed


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
