"""Journal records: each kind keeps its documented wire layout, and one apply serves live and replay."""

from __future__ import annotations

import pytest
from helpers.manager import SPEC, kv_bytes

from kvpool.manager.registry import Registry
from kvpool.manager.state.attachment import Attachment
from kvpool.manager.state.mutations import (
    BlocksEvicted,
    CacheReset,
    DrainingSet,
    EngineFinished,
    ExternalAttached,
    ExternalDetached,
    NodeFinished,
    PoolDropped,
    SessionEnded,
    SessionOpened,
    ShardRegistered,
    StepRan,
    from_wire,
    to_wire,
)
from kvpool.manager.store.journal import apply
from kvpool.shared.protocol import KVSpec

OPS = [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 5, "max_new": 5}]
FAILED = {"op": "save", "level": "host", "src": 1, "dst": 2, "key": b"\x01" * 32}
LATE = {"op": "load", "level": "disk", "src": 3, "dst": 4, "key": b"\x02" * 32}
WIRE = [
    (SessionOpened("s" * 32, "w", "worker", True, 1), ["open", "s" * 32, "w", "worker", True, 1]),
    (SessionEnded("s" * 32, "expired"), ["end", "s" * 32, "expired"]),
    (ShardRegistered("s", "p", 0, 1, "i", KVSpec(**SPEC), 4096, 64, 8), ["register", "s", "p", 0, 1, "i", SPEC, 4096, 64, 8]),
    (StepRan("s", 7, "p", OPS), ["step", "s", 7, "p", OPS]),
    (CacheReset("p"), ["reset", "p"]),
    (BlocksEvicted("p", 3), ["evict", "p", 3]),
    (DrainingSet(True), ["drain", True]),
    (PoolDropped("p"), ["drop", "p"]),
    (ExternalAttached(Attachment("v0", "m", "http://h:8000", 32, "t", None, "tcp://h:5571")),
     ["attach", {"name": "v0", "model": "m", "url": "http://h:8000", "block_size": 32, "topic": "t", "events": None,
                 "replay": "tcp://h:5571"}]),
    (ExternalDetached("v0"), ["detach", "v0"]),
    # late: absent from the record when empty (the layout of journals from before it)
    (NodeFinished("s", "p", 3, [FAILED]), ["node_done", "s", "p", 3, [FAILED]]),
    (NodeFinished("s", "p", 3, [], [LATE]), ["node_done", "s", "p", 3, [], [LATE]]),
    (EngineFinished("s", "l", 4, [FAILED]), ["node_engine_done", "s", "l", 4, [FAILED]]),
    (EngineFinished("s", "l", 4, [FAILED], [LATE]), ["node_engine_done", "s", "l", 4, [FAILED], [LATE]]),
]


def test_records_written_before_a_session_end_had_a_cause_still_load():
    assert from_wire(["end", "s" * 32]) == SessionEnded("s" * 32, "deregister")


@pytest.mark.parametrize(("rec", "wire"), WIRE, ids=[type(r).__name__ for r, _ in WIRE])
def test_each_record_keeps_its_wire_layout_both_ways(rec, wire):
    assert to_wire(rec) == wire
    assert from_wire(wire) == rec


def test_a_list_that_is_no_record_is_refused():
    with pytest.raises(ValueError, match="unknown kind"):
        from_wire(["bogus"])
    with pytest.raises(TypeError):
        from_wire({"kind": "drain"})
    with pytest.raises(TypeError):
        from_wire(["drain"])  # a field missing


def test_the_live_path_journals_exactly_what_replay_applies():
    live = Registry("a", session_timeout_s=10.0)
    live.log = []
    sess = live.open_session("w", "worker", True, 1, 0.0)
    entry = live.register(sess, "p", 0, 1, "i", KVSpec(**SPEC), kv_bytes(16))
    live.step(sess, entry, OPS, 1)
    live.evict(entry, 2)
    live.set_draining(True)
    assert [type(r) for r in live.log] == [SessionOpened, ShardRegistered, StepRan, BlocksEvicted, DrainingSet]
    again = Registry("b", session_timeout_s=10.0)
    again.log = []
    for raw in [to_wire(r) for r in live.log]:
        apply(again, raw, 0.0)
    assert again.log == live.log
    assert again.pools["p"].pool.requests[(sess.sid, 1)].blocks == entry.pool.requests[(sess.sid, 1)].blocks
    assert again.draining and again.sessions[sess.sid].last_step == sess.last_step


def test_attachments_made_by_op_are_journaled_snapshotted_and_refused_when_malformed():
    from kvpool.manager.store.state_file import (
        decode_state,
        dump_registry,
        encode_state,
        load_registry,
    )

    live = Registry("a", session_timeout_s=10.0)
    live.log = []
    v0, v1 = (Attachment(n, "m", f"http://h:{p}", 32, n) for n, p in (("v0", 8000), ("v1", 8001)))
    live.attach(v0)
    live.attach(v1)
    assert live.detach("v1") and not live.detach("v1")  # a second detach changes nothing: not journaled
    assert [type(r) for r in live.log] == [ExternalAttached, ExternalAttached, ExternalDetached]
    again = Registry("b", session_timeout_s=10.0)
    for raw in [to_wire(r) for r in live.log]:
        apply(again, raw, 0.0)
    assert again.attachments == {"v0": v0}
    loaded = Registry("c", session_timeout_s=10.0)
    load_registry(decode_state(encode_state(dump_registry(live, 1))), loaded, 0.0)
    assert loaded.attachments == {"v0": v0}
    with pytest.raises(ValueError, match="attach record"):
        from_wire(["attach", {**v0.to_wire(), "url": "ftp://x"}])
