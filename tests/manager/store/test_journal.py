"""The journal: replaying a manager's records rebuilds its exact state; retried steps; corruption."""

from __future__ import annotations

import random

import pytest
from helpers.durable import CaptureStore, call, durable_server, random_step, settle, state_of
from helpers.manager import SPEC, kv_bytes, ok

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.registry import Registry
from kvpool.manager.state.mutations import DrainingSet
from kvpool.manager.store.journal import decode_batch, encode_batch, encode_lists, recover, replay
from kvpool.manager.store.state_file import decode_state, dump_registry, encode_state
from kvpool.shared.protocol import KVSpec


def register(srv, sid, pool="p", rank=0, count=1, inc="i0", blocks=48):
    return call(srv, "register", sid, pool=pool, shard_rank=rank, shard_count=count, incarnation=inc,
                spec=SPEC, available_kv_bytes=kv_bytes(blocks))


def recovered(store: CaptureStore):
    return durable_server(store=store)


def drive(srv, rng: random.Random, iterations: int, t0: float = 1000.0) -> None:
    """Three clients, two pools (one of two shards), a shard restart, evictions, drains, expiry."""
    shards = [("a", 0, 1, "a0", 48), ("b", 0, 2, "b0", 40), ("b", 1, 2, "b1", 30)]
    clients = []
    for k, shard in enumerate(shards):
        sid = ok(call(srv, "hello", identity=f"c{k}", now=t0))["sid"]
        clients.append({"sid": sid, "alive": [], "rid": [0], "shard": list(shard)})
    now = t0
    for it in range(iterations):
        now += 0.01
        if it == iterations // 2:  # shard a0 restarts: a new epoch, the pool's requests dropped
            clients[0]["shard"][3] = "a0-restarted"
            clients[0]["alive"].clear()
        for c in clients:
            pool, rank, count, inc, blocks = c["shard"]
            epoch = ok(register(srv, c["sid"], pool, rank, count, inc, blocks))["epoch"]
            ops = random_step(rng, c["alive"], c["rid"])
            reply = call(srv, "step", c["sid"], now=now, pool=pool, epoch=epoch, ops=ops)
            if reply["status"] == "ok":
                settle(reply["body"]["results"], ops, c["alive"])
        if it % 7 == 3:
            ok(call(srv, "evict", clients[0]["sid"], now=now, pool="a", n=rng.randint(0, 5)))
        if it % 11 == 5:
            ok(call(srv, "drain", clients[0]["sid"], now=now, enable=it % 22 == 5))
        srv._commit([])
    srv._expire(now + 1e6)  # every session expires: their requests are freed
    srv._commit([])


@pytest.mark.parametrize("seed", range(4))
def test_replaying_the_journal_rebuilds_the_exact_state(seed):
    store = CaptureStore()
    srv = durable_server(store=store)
    drive(srv, random.Random(seed), 40)
    assert store.seq > 40
    assert state_of(recovered(store).registry) == state_of(srv.registry)


def test_a_snapshot_plus_the_journal_after_it_rebuilds_the_same_state():
    store = CaptureStore()
    srv = durable_server(store=store)
    rng = random.Random(9)
    sid = ok(call(srv, "hello"))["sid"]
    ok(register(srv, sid, blocks=64))
    alive, rid = [], [0]
    for i in range(60):
        ops = random_step(rng, alive, rid)
        settle(ok(call(srv, "step", sid, pool="p", epoch=1, ops=ops))["results"], ops, alive)
        srv._commit([])
        if i == 30:
            store.compact(srv.registry)
            assert store.blobs == []
        if i in (10, 45):  # a restart anywhere: the recovered manager continues the same state
            assert state_of(recovered(store).registry) == state_of(srv.registry)
    back = recovered(store)
    assert state_of(back.registry) == state_of(srv.registry)
    back.registry.check_invariants()
    assert back.registry.sessions[sid].last_seen > 0  # a full session timeout to come back


def test_a_retried_step_is_answered_from_the_cache_not_run_twice():
    store = CaptureStore()
    srv = durable_server(store=store)
    sid = ok(call(srv, "hello"))["sid"]
    ok(register(srv, sid))
    ops = [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 9, "max_new": 9}]
    first = call(srv, "step", sid, msg_id=500, pool="p", epoch=1, ops=ops)
    srv._commit([])
    back = recovered(store)  # crashed after the commit, before the reply: the client resends
    again = call(back, "step", sid, msg_id=500, pool="p", epoch=1, ops=ops)
    assert again["body"] == first["body"] and again["status"] == "ok"
    assert back.registry.pools["p"].pool.snapshot_stats()["allocations"] == 1
    late = call(back, "step", sid, msg_id=499, pool="p", epoch=1, ops=ops)
    assert late["status"] == "stale_request"
    assert ok(call(back, "step", sid, msg_id=501, pool="p", epoch=1, ops=ops))["results"][0]["code"] == \
        "duplicate_request"


def test_replies_carry_the_state_id_which_survives_a_restart():
    store = CaptureStore()
    srv = durable_server(store=store)
    body = ok(call(srv, "hello"))
    assert body["durable"] is True and body["state_id"] != body["incarnation"]
    srv._commit([])
    back = recovered(store)
    reply = call(back, "heartbeat", body["sid"])
    assert reply["status"] == "ok" and reply["state"] == body["state_id"] and reply["inc"] != body["incarnation"]


def test_corrupt_or_partial_state_is_refused_never_half_loaded():
    store = CaptureStore()
    srv = durable_server(store=store)
    sid = ok(call(srv, "hello"))["sid"]
    ok(register(srv, sid))
    for i in range(3):
        ok(call(srv, "step", sid, pool="p", epoch=1, ops=[{"op": "alloc", "req": i, "hashes": [],
                                                         "prompt_len": 5, "max_new": 5}]))
        srv._commit([])
    snap, blobs = store.snap, store.blobs

    def load(snap_bytes, batches, committed=3):
        recover(Registry("x", session_timeout_s=1.0), snap_bytes, batches, committed, "test", 0.0)

    load(snap, blobs)  # whole: fine
    flipped = bytearray(blobs[1])
    flipped[-1] ^= 1
    cases = {
        "checksum": (snap[:-1] + bytes([snap[-1] ^ 1]), blobs, 3),
        "magic": (b"x" + snap[1:], blobs, 3),
        "truncated": (snap[:20], blobs, 3),
        "batch checksum": (snap, [blobs[0], bytes(flipped), blobs[2]], 3),
        "gap": (snap, [blobs[0], blobs[2]], 3),
        "missing tail": (snap, blobs[:2], 3),
        "duplicate": (snap, [blobs[0], blobs[0], blobs[1]], 3),
    }
    for name, (s, b, c) in cases.items():
        with pytest.raises(CorruptState):
            load(s, b, c)
        assert name  # each case raised


def test_a_snapshot_that_breaks_an_invariant_is_refused():
    reg = Registry("x", session_timeout_s=1.0)
    s = reg.open_session("w", "worker", True, 1, 0.0)
    reg.register(s, "p", 0, 1, "i", KVSpec(**SPEC), kv_bytes(16))
    reg.pools["p"].pool.allocate((s.sid, 1), [], 8, 8)
    d = dump_registry(reg, 0)
    d["sessions"] = []  # a request whose session is not in the state
    with pytest.raises(CorruptState, match="invariant"):
        recover(Registry("y", session_timeout_s=1.0), encode_state(d), [], 0, "test", 0.0)
    assert decode_state(encode_state(d))["seq"] == 0


def test_batches_round_trip_and_replay_checks_their_order():
    blob = encode_batch(4, [DrainingSet(True)])
    assert decode_batch(blob) == (4, [["drain", True]])
    reg = Registry("x", session_timeout_s=1.0)
    assert replay(reg, [blob], 3, 0.0) == 4 and reg.draining
    with pytest.raises(CorruptState, match="does not follow"):
        replay(Registry("x", session_timeout_s=1.0), [blob], 0, 0.0)
    with pytest.raises(CorruptState, match="unknown kind"):
        replay(Registry("x", session_timeout_s=1.0), [encode_lists(1, [["bogus"]])], 0, 0.0)
