"""Registry: shard registration (min unification, epochs, spec checks) and session lifetimes."""

from __future__ import annotations

import pytest
from helpers.manager import SPEC, kv_bytes

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.kv_events import AllBlocksCleared, BlockStored
from kvpool.manager.registry import GLOBAL, Registry
from kvpool.shared.protocol import KVSpec, ManagerError


def make_registry(**kw) -> Registry:
    kw.setdefault("session_timeout_s", 10.0)
    return Registry("inc-1", **kw)


def reg_shard(r: Registry, sess, rank=0, count=1, inc="a", blocks=64, spec=SPEC, pool="p"):
    return r.register(sess, pool, rank, count, inc, KVSpec(**spec), kv_bytes(blocks, spec))


def test_pool_is_pending_until_every_shard_registers_then_takes_the_min():
    r = make_registry()
    s0, s1 = r.open_session("w0", "worker", True, 1, 0.0), r.open_session("w1", "worker", True, 1, 0.0)
    e = reg_shard(r, s0, rank=0, count=2, blocks=100)
    assert (e.state, e.epoch, e.pool) == ("pending", 0, None)
    # shard 1 holds twice the heads per block: the bytes of 70 two-head blocks hold 35 of its own
    e = r.register(s1, "p", 1, 2, "b", KVSpec(**{**SPEC, "num_kv_heads": 4}), kv_bytes(70))
    assert (e.state, e.epoch, e.pool.blocks.num_blocks) == ("ready", 1, 35)
    assert e.shards[0].num_blocks == 100 and e.shards[1].num_blocks == 35


def test_same_incarnation_is_idempotent_new_one_bumps_epoch_and_drops_state():
    r = make_registry()
    s = r.open_session("w", "worker", True, 1, 0.0)
    e = reg_shard(r, s, blocks=16)
    pool = e.pool
    pool.allocate((s.sid, 1), [b"h" * 32], 8, 8)
    assert reg_shard(r, s, blocks=16).pool is pool and e.epoch == 1
    e = reg_shard(r, s, inc="b", blocks=16)
    assert e.epoch == 2 and e.pool is not pool
    assert e.pool.requests == {} and e.pool.lookup([b"h" * 32]) == 0
    assert e.pool.take_events() == [AllBlocksCleared()]


def test_same_incarnation_with_another_size_is_a_conflict():
    r = make_registry()
    s = r.open_session("w", "worker", True, 1, 0.0)
    reg_shard(r, s, blocks=16)
    with pytest.raises(ManagerError) as ei:
        reg_shard(r, s, blocks=17)
    assert ei.value.code == "shard_conflict"


@pytest.mark.parametrize(
    "field,value", [("block_size", 8), ("num_layers", 3), ("head_size", 16), ("dtype", "float32")]
)
def test_a_disagreeing_live_shard_gets_spec_mismatch_naming_the_field(field, value):
    r = make_registry()
    s0, s1 = r.open_session("a", "worker", True, 1, 0.0), r.open_session("b", "worker", True, 1, 0.0)
    reg_shard(r, s0, rank=0, count=2)
    with pytest.raises(ManagerError) as ei:
        reg_shard(r, s1, rank=1, count=2, inc="b", spec={**SPEC, field: value})
    assert ei.value.code == "spec_mismatch" and field in ei.value.message
    assert len(r.pools["p"].shards) == 1  # nothing changed


def test_shard_count_disagreement_is_a_mismatch():
    r = make_registry()
    s0, s1 = r.open_session("a", "worker", True, 1, 0.0), r.open_session("b", "worker", True, 1, 0.0)
    reg_shard(r, s0, rank=0, count=2)
    with pytest.raises(ManagerError, match="shard_count 4"):
        reg_shard(r, s1, rank=1, count=4, inc="b")


def test_a_new_deployment_replaces_a_pool_whose_shards_are_all_gone():
    r = make_registry()
    s0 = r.open_session("a", "worker", True, 1, 0.0)
    reg_shard(r, s0, rank=0, count=2)
    r.end_session(s0.sid)
    s1 = r.open_session("b", "worker", True, 1, 0.0)
    e = reg_shard(r, s1, rank=0, count=1, inc="new", spec={**SPEC, "block_size": 8})
    assert e.state == "ready" and e.spec.block_size == 8 and e.shard_count == 1


def test_rank_out_of_range_and_too_little_memory_are_refused():
    r = make_registry()
    s = r.open_session("a", "worker", True, 1, 0.0)
    with pytest.raises(ManagerError) as ei:
        reg_shard(r, s, rank=2, count=2)
    assert ei.value.code == "bad_field"
    with pytest.raises(ManagerError) as ei:
        reg_shard(r, s, blocks=1)
    assert ei.value.code == "insufficient_memory" and "at least 2" in ei.value.message
    assert r.pools == {}


def test_num_blocks_is_clamped_to_max_blocks():
    r = make_registry(max_blocks=50)
    s = r.open_session("a", "worker", True, 1, 0.0)
    assert reg_shard(r, s, blocks=10_000).pool.blocks.num_blocks == 50


def test_limits_on_sessions_and_pools():
    r = make_registry(max_sessions=2, max_pools=1)
    s = r.open_session("a", "worker", True, 1, 0.0)
    r.open_session("b", "worker", True, 1, 0.0)
    with pytest.raises(ManagerError, match="2 sessions"):
        r.open_session("c", "worker", True, 1, 0.0)
    reg_shard(r, s, pool="p1")
    with pytest.raises(ManagerError) as ei:
        reg_shard(r, s, pool="p2")
    assert ei.value.code == "too_many_pools"


def test_ending_or_expiring_a_session_frees_exactly_its_requests():
    r = make_registry(session_timeout_s=5.0)
    a, b = r.open_session("a", "worker", True, 1, 0.0), r.open_session("b", "worker", True, 1, 0.0)
    pool = reg_shard(r, a, blocks=32).pool
    pool.allocate((a.sid, 1), [], 8, 8)
    pool.allocate((a.sid, 2), [], 8, 8)
    pool.allocate((b.sid, 1), [], 8, 8)
    b.last_seen = 4.0
    r.dirty.clear()
    expired = r.expire(now=5.5)  # a silent 5.5s > 5s; b silent 1.5s
    assert [(s.identity, n) for s, n in expired] == [("a", 2)]
    assert list(pool.requests) == [(b.sid, 1)] and r.dirty == {GLOBAL, "p"}
    # the shard stays registered, bound to the dead session: its worker died (pool health "lost")
    assert r.pools["p"].shards[0].sid == a.sid and a.sid not in r.sessions
    r.check_invariants()
    assert r.end_session(b.sid) == 1 and pool.blocks.num_free == 31


def test_check_invariants_catches_a_request_of_a_dead_session():
    r = make_registry()
    a = r.open_session("a", "worker", True, 1, 0.0)
    pool = reg_shard(r, a).pool
    pool.allocate(("not-a-session", 1), [], 8, 8)
    with pytest.raises(AssertionError, match="dead session"):
        r.check_invariants()


@pytest.mark.parametrize("inc", ["a", "b"])
def test_a_new_shard_count_replaces_the_pool_never_leaves_it_ready_without_its_shards(inc):
    r = make_registry()
    s = r.open_session("w", "worker", True, 1, 0.0)
    old = reg_shard(r, s, blocks=16)
    old.pool.allocate((s.sid, 1), [b"h" * 32], 8, 8)
    r.orphan_events = []
    e = reg_shard(r, s, rank=0, count=2, inc=inc, blocks=16)
    assert (e.state, e.shard_count, e.epoch, list(e.shards)) == ("pending", 2, 1, [0])
    r.check_invariants()  # was: "ready without all shards", serving the old block space
    assert r.orphan_events == [("p", 1, [BlockStored([b"h" * 32], None), AllBlocksCleared()])]
    e = reg_shard(r, s, rank=1, count=2, inc="c", blocks=16)
    assert (e.state, e.epoch) == ("ready", 2) and e.pool.requests == {}


def test_a_shard_that_leaves_a_waiting_pool_is_forgotten_so_the_pool_never_forms_with_it():
    r = make_registry()
    s0, s1, s2 = (r.open_session(f"w{i}", "worker", False, 1, 0.0) for i in range(3))
    reg_shard(r, s0, rank=0, count=3, inc="a0")
    reg_shard(r, s1, rank=1, count=3, inc="a1")
    r.end_session(s1.sid)  # rank 1's process died before rank 2 arrived
    entry = reg_shard(r, s2, rank=2, count=3, inc="a2")
    assert entry.state == "pending" and sorted(entry.shards) == [0, 2], "rank 1 must register again"
    s1b = r.open_session("w1b", "worker", False, 1, 0.0)
    entry = reg_shard(r, s1b, rank=1, count=3, inc="a1-restarted")
    assert entry.state == "ready" and entry.epoch == 1
    r.check_invariants()


def test_the_last_shard_of_a_waiting_pool_keeps_its_spec_when_it_leaves():
    r = make_registry()
    s0 = r.open_session("w0", "worker", False, 1, 0.0)
    reg_shard(r, s0, rank=0, count=2, inc="a0")
    r.end_session(s0.sid)
    assert list(r.pools["p"].shards) == [0] and r.pools["p"].shards[0].sid is None


def test_a_shard_expiring_while_its_pool_waits_is_forgotten_as_on_deregister():
    r = make_registry()
    s0 = r.open_session("w0", "worker", False, 1, 0.0)
    s1 = r.open_session("w1", "worker", False, 1, 0.0)
    reg_shard(r, s0, rank=0, count=3, inc="a0")
    reg_shard(r, s1, rank=1, count=3, inc="a1")
    s0.last_seen = 100.0  # rank 0 keeps talking; rank 1 goes silent and expires
    assert [s.sid for s, _ in r.expire(100.0)] == [s1.sid]
    s2 = r.open_session("w2", "worker", False, 1, 100.0)
    entry = reg_shard(r, s2, rank=2, count=3, inc="a2")
    assert entry.state == "pending" and sorted(entry.shards) == [0, 2]
    r.check_invariants()


def test_check_catches_a_ready_multi_shard_pool_with_a_dead_shard():
    r = make_registry()
    s0, s1 = (r.open_session(f"w{i}", "worker", False, 1, 0.0) for i in range(2))
    reg_shard(r, s0, rank=0, count=2, inc="a0")
    entry = reg_shard(r, s1, rank=1, count=2, inc="a1")
    r.check_invariants()
    entry.shards[1].sid = None  # what the deregister-while-pending bug left behind
    with pytest.raises(InvariantBroken, match=r"shards \[1\] whose sessions are gone"):
        r.check_invariants()
    entry.shards[1].sid = s1.sid
    single = reg_shard(r, s0, pool="q", inc="b")
    r.end_session(s0.sid)  # p drops back to pending; q, a single-shard pool, keeps its state
    assert (entry.state, single.state, single.shards[0].sid) == ("pending", "ready", None)
    r.check_invariants()


@pytest.mark.parametrize("leave", ["deregister", "expired"])
def test_a_pool_does_not_form_with_the_shard_that_stayed_only_for_its_spec(leave: str):
    """Rank 0 of two registers and leaves (deregisters, or its session expires); rank 1 arrives:
    the pool waits (one live shard of two), and forms when rank 0 registers again."""
    r = make_registry()
    s0 = r.open_session("w0", "worker", False, 1, 0.0)
    reg_shard(r, s0, rank=0, count=2, inc="a0")
    if leave == "deregister":
        r.end_session(s0.sid)
    else:
        assert [s.sid for s, _ in r.expire(100.0)] == [s0.sid]
    s1 = r.open_session("w1", "worker", False, 1, 100.0)
    entry = reg_shard(r, s1, rank=1, count=2, inc="a1")
    assert entry.state == "pending" and entry.live_shards(r.sessions) == 1
    with pytest.raises(ManagerError, match="1 of 2 shards registered"):
        r.ready_pool("p")
    r.check_invariants()
    s0b = r.open_session("w0b", "worker", False, 1, 100.0)
    entry = reg_shard(r, s0b, rank=0, count=2, inc="a0-restarted")
    assert entry.state == "ready" and entry.live_shards(r.sessions) == 2
    r.check_invariants()


def test_a_rank_registering_again_with_its_incarnation_completes_a_waiting_pool():
    """The twin with the same incarnation: the unbound shard is re-bound, and that registration
    is the one the pool waited for."""
    r = make_registry()
    s0 = r.open_session("w0", "worker", False, 1, 0.0)
    reg_shard(r, s0, rank=0, count=2, inc="a0")
    r.end_session(s0.sid)
    s1 = r.open_session("w1", "worker", False, 1, 0.0)
    assert reg_shard(r, s1, rank=1, count=2, inc="a1").state == "pending"
    s0b = r.open_session("w0b", "worker", False, 1, 0.0)
    entry = reg_shard(r, s0b, rank=0, count=2, inc="a0")  # the same process, a new session
    assert entry.state == "ready" and entry.shards[0].sid == s0b.sid
    assert reg_shard(r, s0b, rank=0, count=2, inc="a0").epoch == entry.epoch  # twice: idempotent
    r.check_invariants()
