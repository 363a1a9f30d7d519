"""Token sampling: greedy, temperature, top-k, top-p, penalties, min_tokens; seeded and
independent of batching; optional log-probabilities.

The random draw of a request's k-th output token of sample ``index`` depends only on
``(seed, index, k)``, so a request gives the same tokens whatever it was batched with, and after
preemption and recompute.

Order of processing one row, as vLLM 0.33's sampler does it (vllm/v1/sample/sampler.py,
ops/penalties.py, logits_processor/builtin.py): ``min_tokens`` bans every stop id (the model's
eos ids and the request's stop_token_ids); the repetition penalty over the prompt and output
tokens (a positive logit divided by it, a negative one multiplied); presence and frequency
penalties over the output tokens (``logit -= presence * [count > 0] + frequency * count``);
then, unless greedy, temperature, min_p (tokens below ``min_p`` times the top probability
dropped), top-k, top-p. Log-probabilities are of the model's raw distribution (log_softmax of the
unprocessed logits).

Sample ``i`` of an ``n`` request draws as the n=1 request with seed ``seed + i`` would (vLLM
gives each parallel sample that seed: vllm/v1/engine/parallel_sampling.py).
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
    prompt: Sequence[int] = ()  # needed by the repetition penalty only


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # best first


def _draw_seed(key: SampleKey) -> int:
    return ((key.seed + key.index) * 1_000_003 + key.step) % _MIX  # sample i: the seed seed + i


def _counts(tokens: Sequence[int], vocab: int, like: torch.Tensor) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(list(tokens), dtype=torch.long), minlength=vocab)
    return counts[:vocab].to(like.device, like.dtype)


def _process(logits: torch.Tensor, key: SampleKey) -> torch.Tensor:
    # logits: [vocab] fp32; returns a new tensor
    p = key.params
    logits = logits.clone()
    vocab = logits.numel()
    if key.banned:
        ids = [t for t in key.banned if t < vocab]
        logits[ids] = float("-inf")
    if p.repetition_penalty != 1.0 and (key.output or key.prompt):
        seen = _counts([*key.prompt, *key.output], vocab, logits) > 0
        scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if (p.presence_penalty or p.frequency_penalty) and key.output:
        counts = _counts(key.output, vocab, logits)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
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
    if p.min_p > 0.0:  # after temperature, as vLLM's MinPLogitsProcessor
        probs = probs.masked_fill(probs < probs.max() * p.min_p, 0.0)
        probs = probs / probs.sum()
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
    return p.greedy and not key.banned and not (p.penalized and (key.output or key.prompt))


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
