from __future__ import annotations

import pytest
import torch
from helpers.worker import make_engine, make_prompt

from kvpool.worker.sampler import SampleKey, SamplingParams, sample


def keys(params, n, seed=0, step=0):
    return [SampleKey(params, seed, i, step) for i in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert sample(logits, keys(SamplingParams(), 5)) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax():
    logits = torch.randn(6, 50)
    p = SamplingParams(temperature=2.0, top_p=1e-6)
    assert sample(logits, keys(p, 6)) == logits.argmax(-1).tolist()


def test_seeded_and_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, [SampleKey(p, 7, 0, step)])[0] for step in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03, rtol=0)
    again = [sample(logits, [SampleKey(p, 7, 0, step)])[0] for step in range(4000)]
    assert draws == again


def test_top_p_drops_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7)
    draws = {sample(logits, [SampleKey(p, 1, 0, s)])[0] for s in range(500)}
    assert draws == {0, 1}


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(n=0)])
def test_params_validate(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_seeded_request_independent_of_batch():
    prompt = make_prompt(23, 1)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, n=2)
    alone = make_engine().generate([prompt], params)[0]
    others = [make_prompt(30 + i, 9 + i) for i in range(3)]
    crowded = make_engine().generate(others + [prompt], params)[-1]
    assert alone == crowded
    assert alone[0] != alone[1]  # the two samples draw differently
