"""Which tokens a forward pass draws: the rows of a batch's logits, each sampled for a request.

A sequence that reached its last known token (``BatchSeq.sample``) draws one token; an n > 1
request on its first step draws all n from its one row (``Output.sample`` says which of them;
the scheduler spawns the others as requests of their own); one aborted after its batch was made
draws none. Each draw's ``SampleKey`` carries what its sampling depends on (worker/sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.worker.request import Request
from kvpool.worker.sampler import SampleKey, sample_rows
from kvpool.worker.step_plan import Batch, Output


def draw_tokens(batch: Batch, logits: torch.Tensor, eos_token_ids: Sequence[int]) -> list[Output]:
    """The tokens ``batch``'s sampling sequences draw from ``logits`` (one row each, in order)."""
    sampling = [req for req, seq in zip(batch.reqs, batch.seqs) if seq.sample]
    keys, owners = [], []
    for row, req in enumerate(sampling):
        if req.finish_reason is not None:
            continue  # aborted after its batch was made (overlap): nothing to sample
        count = req.params.n if req.holds_all_samples else 1
        for i in range(count):
            index = i if req.holds_all_samples else req.index
            keys.append(sample_key(req, index, eos_token_ids))
            owners.append((row, req, i))
    if not owners:
        return []
    rows = [row for row, _, _ in owners]
    if rows != list(range(len(sampling))):  # an n > 1 request's first step draws n rows; aborted ones none
        logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
    drawn = sample_rows(logits, keys)
    return [Output(req, got.token, i, got.logprob, got.top_logprobs) for (_, req, i), got in zip(owners, drawn)]


def sample_key(req: Request, index: int, eos_token_ids: Sequence[int]) -> SampleKey:
    """What sample ``index`` of ``req`` draws its next token from."""
    p = req.params
    output = req.tokens[req.num_prompt:] if p.penalized else ()
    prompt = req.tokens[:req.num_prompt] if p.repetition_penalty != 1.0 else ()
    banned: tuple[int, ...] = ()
    if req.num_output < p.min_tokens:  # every id that would stop it, as vLLM masks them
        banned = p.stop_token_ids + tuple(eos_token_ids)
    return SampleKey(p, req.seed, index, req.num_output, output, banned, prompt)
