"""The step records encode to PROTOCOL.md section 6's maps, byte for byte, and decode back."""

from __future__ import annotations

import pytest

from kvpool.shared.protocol import pack
from kvpool.shared.step_ops import (
    FREED,
    NO_SPACE,
    Alloc,
    AllocResult,
    Extend,
    ExtendResult,
    Fork,
    Forked,
    Free,
    Refused,
    decode_ops,
    decode_results,
)

H = bytes(range(32))
OPS = [
    (Alloc(7, [H], 20, 20), {"op": "alloc", "req": 7, "hashes": [H], "prompt_len": 20, "max_new": 20}),
    (Alloc("r", [], 3, 3, 0), {"op": "alloc", "req": "r", "hashes": [], "prompt_len": 3, "max_new": 3, "lookahead": 0}),
    (Extend(7, 33), {"op": "extend", "req": 7, "num_tokens": 33}),
    (Extend(7, 33, [H], 0, 17), {"op": "extend", "req": 7, "num_tokens": 33, "hashes": [H], "lookahead": 0, "base": 17}),
    (Free(3), {"op": "free", "req": 3}),
    (Free(3, 12), {"op": "free", "req": 3, "computed": 12}),
    (Fork(1, 2), {"op": "fork", "req": 1, "child": 2}),
]
RESULTS = [
    (Alloc(1, [], 5, 5), AllocResult(0, [4, 5]), {"ok": True, "cached": 0, "blocks": [4, 5]}),
    (Alloc(1, [], 5, 5), AllocResult(4, [4, 5], [[9, 1]], [[4, 2]], [[3, 5]]),
     {"ok": True, "cached": 4, "blocks": [4, 5], "writes": [[9, 1]], "saves": [[4, 2]], "loads": [[3, 5]]}),
    (Extend(1, 9), ExtendResult([6], [[0, 4, 7]]), {"ok": True, "blocks": [6], "copies": [[0, 4, 7]]}),
    (Extend(1, 9), ExtendResult([], [], [[6, 0]]), {"ok": True, "blocks": [], "copies": [], "writes": [[6, 0]]}),
    (Free(1), FREED, {"ok": True}),
    (Fork(1, 2), Forked([4, 5]), {"ok": True, "blocks": [4, 5]}),
    (Alloc(1, [], 5, 5), NO_SPACE, {"ok": False, "code": "no_space", "msg": "not enough free blocks"}),
]


@pytest.mark.parametrize(("record", "wire"), OPS)
def test_a_sub_op_encodes_to_its_documented_map_and_back(record, wire):
    assert pack(record.to_wire()) == pack(wire)  # same keys, same order, optional keys absent
    assert decode_ops([wire]) == [record]


@pytest.mark.parametrize(("op", "record", "wire"), RESULTS)
def test_a_result_encodes_to_its_documented_map_and_back(op, record, wire):
    assert pack(record.to_wire()) == pack(wire)
    assert decode_results([op], [wire]) == [record]


def test_a_bad_sub_op_decodes_to_the_refusal_that_answers_it():
    assert decode_ops([7, {"op": "nope"}, {"op": "alloc", "req": -1}]) == [
        Refused("bad_sub_op", "a sub-op must be a map, got int"),
        Refused("unknown_sub_op", "unknown sub-op 'nope'; known: ['alloc', 'extend', 'fork', 'free']"),
        Refused("bad_field", "field 'req' must be an int >= 0 or a str of 1-128 chars, got -1"),
    ]
