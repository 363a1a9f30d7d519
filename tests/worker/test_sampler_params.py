"""The sampler's OpenAI parameters: top_k, penalties, min_tokens, stop ids, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.worker import make_engine, make_prompt

from kvpool.worker.sampler import SampleKey, SamplingParams, sample, sample_rows


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.25]]))
    p = SamplingParams(temperature=1.0, top_k=2)
    draws = {sample(logits, [SampleKey(p, 3, 0, s)])[0] for s in range(400)}
    assert draws == {1, 2}


def test_presence_and_frequency_penalties_lower_repeated_tokens() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.5, 0.0]])
    assert sample(logits, [SampleKey(SamplingParams(), 0, 0, 0, output=[0])]) == [0]  # no penalty: argmax
    presence = SamplingParams(presence_penalty=0.2)
    assert sample(logits, [SampleKey(presence, 0, 0, 1, output=[0])]) == [1]
    freq = SamplingParams(frequency_penalty=0.04)  # one repeat costs 0.04: not enough, three do
    assert sample(logits, [SampleKey(freq, 0, 0, 1, output=[0])]) == [0]
    assert sample(logits, [SampleKey(freq, 0, 0, 3, output=[0, 0, 0])]) == [1]
    negative = SamplingParams(presence_penalty=-2.0)  # a negative penalty favours repeats
    assert sample(logits, [SampleKey(negative, 0, 0, 1, output=[2])]) == [2]


def test_banned_ids_are_never_drawn() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    assert sample(logits, [SampleKey(SamplingParams(), 0, 0, 0, banned=(0,))]) != [0]
    p = SamplingParams(temperature=1.0)
    assert all(sample(logits, [SampleKey(p, 1, 0, s, banned=(0,))])[0] != 0 for s in range(100))


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    got = sample_rows(logits, [SampleKey(SamplingParams(logprobs=2), 0, 0, 0)])[0]
    assert got.token == 1
    assert math.isclose(got.logprob, math.log(0.6), rel_tol=1e-5)
    assert [t for t, _ in got.top_logprobs] == [1, 2]
    assert sample_rows(logits, [SampleKey(SamplingParams(), 0, 0, 0)])[0].logprob is None


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(min_tokens=20, max_tokens=10), dict(presence_penalty=3),
                                 dict(frequency_penalty=-2.5), dict(logprobs=21), dict(stop_token_ids=[-1]),
                                 dict(stop_token_ids=5)])
def test_new_params_validate(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_engine_stops_on_a_stop_id_after_min_tokens() -> None:
    engine = make_engine()
    prompt = make_prompt(20, 5)
    free = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0][0]
    stop = free[3]
    first = free.index(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))[0][0]
    assert out == free[: first + 1]  # greedy: the same tokens up to and including the stop id
    late = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
                                                    min_tokens=first + 2))[0][0]
    assert stop not in late[: first + 2] and len(late) >= first + 2


def test_engine_events_carry_logprobs() -> None:
    engine = make_engine()
    engine.add_request(make_prompt(10, 2), SamplingParams(max_tokens=3, logprobs=3, ignore_eos=True))
    events = []
    while engine.has_work():
        events += engine.step()
    assert len(events) == 3
    for ev in events:
        assert ev.logprob is not None and ev.logprob <= 0 and len(ev.top_logprobs) == 3
        assert ev.top_logprobs[0][1] >= ev.logprob  # greedy: the sampled token is the best one
        assert ev.top_logprobs[0][0] == ev.token
