"""A request's cache_salt keeps tenants' prefix caches apart inside one worker."""

from __future__ import annotations

import pytest
from helpers.worker import make_engine, make_prompt

from kvpool.shared.hashing import hash_blocks
from kvpool.worker.sampler import SamplingParams


def run(engine, prompt, salt):
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True, n=2, temperature=1.0), cache_salt=salt)
    while engine.has_work():
        engine.step()
    return engine.scheduler.stats.cached_tokens


def test_the_same_prompt_hits_only_under_the_same_salt():
    engine = make_engine()
    prompt = make_prompt(70, 3)
    assert run(engine, prompt, "tenant-a") == 0
    assert run(engine, prompt, "tenant-b") == 0  # another tenant: no hit
    assert run(engine, prompt, None) == 0  # no salt: its own space
    hit = run(engine, prompt, "tenant-a")
    assert hit == 64  # four full blocks of 16 (the last prompt token is always recomputed)
    salted = hash_blocks(prompt, 16, cache_salt="tenant-a")
    assert engine.bm.core.lookup(salted) == 4 and engine.bm.core.lookup(hash_blocks(prompt, 16)) == 4


def test_a_bad_salt_is_refused():
    with pytest.raises(ValueError, match="cache_salt"):
        make_engine().add_request([5, 6], cache_salt="")
