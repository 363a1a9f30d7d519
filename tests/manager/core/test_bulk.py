"""The piecewise bulk helpers (manager/core/bulk.py) give exactly what the one-call builtins give,
at piece sizes that cut every input into many pieces and at the real one."""

from __future__ import annotations

import random
from array import array

import pytest

from kvpool.manager.core import bulk


@pytest.fixture(params=[1, 3, bulk.PIECE])
def piece(request, monkeypatch):
    monkeypatch.setattr(bulk, "PIECE", request.param)
    return request.param


def test_each_helper_equals_its_builtin(piece):
    rng = random.Random(piece)
    for n in (0, 1, 2, 3, 7, 50):
        xs = [rng.randrange(-5, 40) for _ in range(n)]
        assert [p for part in bulk.pieces(xs) for p in part] == xs
        assert [p for part in bulk.pieces(iter(xs)) for p in part] == xs
        assert all(len(part) <= piece for part in bulk.pieces(iter(xs)))
        assert bulk.bulk_list(map(abs, xs)) == list(map(abs, xs))
        assert bulk.bulk_all(x > -3 for x in xs) == all(x > -3 for x in xs)
        assert bulk.truthy_at([x % 3 == 0 for x in xs]) == [i for i, x in enumerate(xs) if x % 3 == 0]
        if xs:
            assert (bulk.bulk_min(xs), bulk.bulk_max(xs)) == (min(xs), max(xs))
        target = [None] * 40
        at = [abs(x) for x in xs]
        bulk.bulk_store(target, at, range(len(at)))
        expected = [None] * 40
        for i, b in enumerate(at):
            expected[b] = i
        assert target == expected
        ids = [abs(x) for x in xs]
        m = bulk.marks(40, ids)
        assert [i for i in range(40) if m[i]] == sorted(set(ids))
        assert (m.count(1) == len(ids)) == (len(set(ids)) == len(ids))
        arr = array("I", [abs(x) for x in xs])
        assert bulk.array_to_list(arr) == arr.tolist()
        data = bytes(rng.randrange(256) for _ in range(4 * n))
        assert bulk.split_every(data, 4) == [data[i : i + 4] for i in range(0, len(data), 4)]


def test_all_stops_at_the_first_piece_with_a_false_item(piece):
    seen = []

    def items():
        for i in range(10 * piece):
            seen.append(i)
            yield i != piece  # false in the second piece
    assert bulk.bulk_all(items()) is False
    assert len(seen) <= 2 * piece


def test_a_mark_past_the_end_is_an_index_error():
    with pytest.raises(IndexError):
        bulk.marks(4, [1, 4])
