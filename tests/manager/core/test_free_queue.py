"""The free queue against a plain-list model of DESIGN invariant 7, over long random runs.

The model is the queue as one Python list, front first: unhashed pushes go to its front, hashed
ones to its back, removals take a block out of the middle. The runs are long enough for the LRU
segment's consumed head to be cut off many times (and tombstones to straddle the cuts).
"""

import random

import pytest

from kvpool.manager.core import free_queue
from kvpool.manager.core.free_queue import FreeQueue

NUM_BLOCKS = 1500


def push(fq: FreeQueue, blocks: list[int], hashed: set[int]) -> None:
    """Frees ``blocks`` the way BlockPool.free_blocks does, through the releaser."""
    push_back, pos, k = fq.releaser()
    for b in blocks:
        if b in hashed:
            pos[b] = k
            k += 1
            push_back(b)
    fq.prepend([b for b in blocks if b not in hashed])


def model_push(model: list[int], blocks: list[int], hashed: set[int]) -> None:
    """Unhashed blocks to the front in the order freed (the first freed is reused first),
    hashed ones to the back."""
    model[:0] = [b for b in blocks if b not in hashed]
    model += [b for b in blocks if b in hashed]


@pytest.mark.parametrize("compact_min", [16, free_queue._COMPACT_MIN])
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_list_model(seed, compact_min, monkeypatch):
    monkeypatch.setattr(free_queue, "_COMPACT_MIN", compact_min)  # 16: cut the head often
    rng = random.Random(seed)
    fq = FreeQueue(range(1, NUM_BLOCKS))
    model = list(range(1, NUM_BLOCKS))
    hashed: set[int] = set()  # blocks that hold a hash (free or not)
    held: list[int] = []
    cuts = 0
    for step in range(4000):
        head_before = fq._head  # reads only
        op = rng.random()
        if op < 0.4 and model:
            n = rng.randint(1, min(40, len(model)))
            unhashed, lru = fq.pop(n)
            assert unhashed + lru == model[:n], step
            del model[:n]
            for b in lru:
                hashed.discard(b)  # the pool drops the hashes of the blocks it evicts
            held += unhashed + lru
        elif op < 0.75 and held:
            rng.shuffle(held)
            k = rng.randint(1, min(40, len(held)))
            freed, held = held[:k], held[k:]
            for b in freed:
                if rng.random() < 0.8:
                    hashed.add(b)
            push(fq, freed, hashed)
            model_push(model, freed, hashed)
        elif op < 0.9:
            free_hashed = [b for b in model if b in hashed]
            if free_hashed:
                b = rng.choice(free_hashed)  # a prefix-cache hit revives it
                fq.remove(b)
                model.remove(b)
                held.append(b)
        elif op < 0.95:
            n = rng.randint(0, fq.num_hashed())
            evicted = fq.pop_hashed(n)
            first_hashed = len(model) - fq.num_hashed() - n
            assert evicted == model[first_hashed:first_hashed + n]
            del model[first_hashed:first_hashed + n]
            for b in evicted:
                hashed.discard(b)
                fq.move_to_front(b)
                model.insert(0, b)
        elif op < 0.97:
            front, lru = fq.segments()
            fq = FreeQueue.from_segments(list(front), list(lru))
            fq.reserve(NUM_BLOCKS)
        else:
            moved = fq.clear_hashes()
            assert moved == [b for b in model if b in hashed]
            hashed.difference_update(moved)
            model = [b for b in model if b not in set(moved)] + moved  # the order stays
        cuts += fq._head < head_before  # the consumed head was cut off
        assert fq.order() == model, step
        assert len(fq) == len(model)
        assert fq.num_hashed() == sum(1 for b in model if b in hashed)
    assert cuts, "the run never cut the LRU segment's head: make it longer"


def test_remove_of_a_block_not_queued_hashed_raises_and_changes_nothing():
    fq = FreeQueue(range(1, 8))
    fq.pop(7)
    push(fq, [3], set())  # not hashed: the front segment
    push(fq, [5, 6], {5, 6})
    before = fq.order()
    for b in (3, 4, 0):
        with pytest.raises(KeyError):
            fq.remove(b)
    assert fq.order() == before
    fq.remove(5)
    with pytest.raises(KeyError):
        fq.remove(5)  # already taken out
    assert fq.order() == [3, 6]
