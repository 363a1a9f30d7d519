"""check_step's one-pass block bound against the exact projection it stands in for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.manager.core.pool import Pool
from kvpool.manager.guards import Bounds, _projected_work, check_step
from kvpool.manager.state.entries import PoolEntry
from kvpool.shared.protocol import ManagerError
from kvpool.shared.step_ops import decode_ops

BS = 4


def make_entry(held: dict[int, int]) -> PoolEntry:
    """A ready pool of block size 4 where request r of owner "o" holds held[r] tokens."""
    entry = PoolEntry("p", 1)
    entry.pool = Pool(256, BS)
    for req, tokens in held.items():
        assert entry.pool.allocate(("o", req), [], tokens, tokens) is not None
    return entry


reqs = st.one_of(st.integers(0, 5), st.sampled_from(["a", "b"]), st.none())
counts = st.one_of(st.integers(0, 80), st.just(-1), st.just(True), st.none())
sub_op = st.fixed_dictionaries(
    {"op": st.sampled_from(["alloc", "extend", "fork", "free", "nope"]), "req": reqs},
    optional={"prompt_len": counts, "num_tokens": counts, "lookahead": counts, "max_new": counts,
              "child": reqs},
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(sub_op, st.just(7)), max_size=12), limit=st.integers(0, 60),
       held=st.dictionaries(st.integers(0, 5), st.integers(1, 40), max_size=4))
def test_a_step_is_refused_exactly_when_its_projected_work_is_over_the_limit(ops, limit, held):
    entry = make_entry(held)
    ops = decode_ops(ops)
    refused = _projected_work(BS, entry, "o", ops) > limit
    try:
        check_step(Bounds(max_step_blocks=limit), entry, "o", ops)
    except ManagerError as e:
        assert e.code == "step_too_large" and refused
    else:
        assert not refused


def test_a_fork_is_projected_even_when_the_token_bound_is_small():
    entry = make_entry({0: 40})  # 10 blocks shared by each fork
    forks = decode_ops([{"op": "fork", "req": 0, "child": 10 + i} for i in range(3)])
    check_step(Bounds(max_step_blocks=30), entry, "o", forks)
    with pytest.raises(ManagerError, match="up to 30 blocks; at most 29"):
        check_step(Bounds(max_step_blocks=29), entry, "o", forks)
