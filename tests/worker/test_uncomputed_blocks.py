"""No cached hash names a block whose K/V was never written. With overlap the step after a
request's running one is composed and answered before that request's update; when the update
preempts (or finishes) it, that next step never runs for it, yet the manager entered the hashes
of the blocks it was to fill. The free then says how many tokens were computed, and the manager
drops the hashes past them (worker/running_set.py, manager/core/pool.py ``free``).

Blocks handed out are filled with a poison value first, standing for whatever a reused device
block holds: a prefix hit on a block no forward pass wrote then changes the output."""

from __future__ import annotations

import random

import pytest
from helpers.worker import greedy, make_engine, make_prompt, reference, run_dry

POISON = 1e4


def poison_new_blocks(engine) -> list[tuple[int, int]]:
    """Every block the pool hands out is poisoned first; returns the list that collects
    (position, block) of any poisoned slot a forward pass reads as cached context."""
    bp, runner, block_size = engine.bm.core.blocks, engine.runner, engine.block_size
    cached, new, execute, reads = bp.get_cached_blocks, bp.get_new_blocks, runner.execute, []

    def poisoned(out: list[int]) -> list[int]:
        for cache in runner.kv_caches:
            cache[:, out] = POISON
        return out

    def get_cached_blocks(n, hashes, parent):  # allocations
        return poisoned(cached(n, hashes, parent))

    def get_new_blocks(n):  # extensions
        return poisoned(new(n))

    def checked_execute(plan, *, sample=True):
        for s in plan.seqs:
            for pos in range(s.start):
                block = s.block_table[pos // block_size]
                if bool((runner.kv_caches[0][:, block, pos % block_size] == POISON).any()):
                    reads.append((pos, block))
                    break
        return execute(plan, sample=sample)

    bp.get_cached_blocks, bp.get_new_blocks, runner.execute = get_cached_blocks, get_new_blocks, checked_execute
    return reads


@pytest.mark.parametrize("seed", [9, 10])
def test_preempted_with_its_next_step_answered_leaves_no_hash_of_unwritten_kv(seed):
    rng = random.Random(seed)
    engine = make_engine(max_blocks=10, overlap=True, max_num_batched_tokens=32, max_model_len=128)
    reads = poison_new_blocks(engine)
    shared = make_prompt(60, seed)
    asked = []
    for i in range(14):  # shared prefixes, chunked prefill, staggered ends: preemptions with overlap
        prompt = shared[: rng.randrange(0, 60)] + make_prompt(rng.randrange(5, 50), seed * 100 + i)
        max_tokens = rng.randrange(1, 25)
        asked.append((prompt, max_tokens, engine.add_request(prompt, greedy(max_tokens))))
    got: dict[str, list[int]] = {}
    run_dry(engine, got)
    assert engine.scheduler.stats.preemptions > 0
    assert [got[rid] for _, _, rid in asked] == [reference(engine, p, n) for p, n, _ in asked]
    assert reads == []  # no cached context read was left unwritten, whatever the output
    engine.bm.core.check_invariants()
