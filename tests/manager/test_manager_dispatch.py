"""The server's dispatch without sockets: every op, its error codes, and what it must not change."""

from __future__ import annotations

import msgpack
import pytest
from helpers.manager import SPEC, call, hello, kv_bytes, make_server, ok, register

from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import OPS, Server
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.protocol import ERROR_CODES, MAX_HASHES, pack, unpack

H = hash_blocks(list(range(64)), SPEC["block_size"])  # 16 full blocks


def alloc(req, n_tokens=16, hashes=None):
    return {"op": "alloc", "req": req, "hashes": H[: n_tokens // 4] if hashes is None else hashes,
            "prompt_len": n_tokens, "max_new": n_tokens}


def ready_server(**cfg):
    srv = make_server(**cfg)
    sid = hello(srv)
    ok(register(srv, sid, blocks=32))
    return srv, sid


def test_hello_negotiates_the_highest_common_version_and_reports_the_incarnation():
    srv = make_server()
    body = ok(call(srv, "hello", identity="w0", role="worker", versions=[1, 7]))
    assert body["version"] == 1 and body["incarnation"] == srv.incarnation
    assert body["limits"]["max_sub_ops"] == srv.cfg.max_sub_ops and len(body["sid"]) == 32
    bad = call(srv, "hello", versions=[2, 3])
    assert bad["status"] == "unsupported_version" and bad["body"]["versions"] == [1]


def test_every_reply_carries_id_and_incarnation_and_the_envelope_is_checked():
    srv = make_server()
    r = unpack(srv.handle_payload(pack({"v": 1, "id": 42, "op": "nope", "args": {}}), 0.0))
    assert (r["id"], r["status"], r["inc"]) == (42, "unknown_op", srv.incarnation)
    for msg, code in [
        (b"\xc1", "bad_message"),  # never-used msgpack byte
        (pack([1, 2]), "bad_message"),
        (pack({"v": 1, "id": -1, "op": "hello"}), "bad_message"),
        (pack({"v": 9, "id": 1, "op": "hello"}), "unsupported_version"),
        (pack({"v": 1, "id": 1, "op": "hello", "args": [1]}), "bad_message"),
        (pack({"v": 1, "id": 1, "op": "stats"}), "unknown_session"),
        (pack({"v": 1, "id": 1, "op": "stats", "sid": "f" * 32}), "unknown_session"),
        (b"\x00" * (srv.cfg.max_message_bytes + 1), "too_large"),
    ]:
        assert unpack(srv.handle_payload(msg, 0.0))["status"] == code, msg[:20]
    assert all(code in ERROR_CODES for code in srv.stats.errors)


def test_frames_with_a_bad_envelope_are_dropped_and_counted():
    srv = make_server()
    assert srv.handle_frames([b"id"], 0.0) is None
    assert srv.handle_frames([b"id", b"x", b"y"], 0.0) is None
    req = pack({"v": 1, "id": 5, "op": "hello", "args": {}})
    assert srv.handle_frames([b"id", b"", req], 0.0)[:2] == [b"id", b""]  # REQ-style framing mirrored
    assert srv.stats.dropped == 2 and srv.stats.messages == 1


def test_step_runs_sub_ops_in_order_and_reports_each():
    srv, sid = ready_server()
    first = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1)]))["results"]
    assert first == [{"ok": True, "cached": 0, "blocks": [1, 2, 3, 4]}]
    res = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[
        alloc(2), {"op": "extend", "req": 1, "num_tokens": 18}, {"op": "fork", "req": 1, "child": 3},
        {"op": "free", "req": 9}, {"op": "bogus"},
    ]))["results"]
    res.insert(0, first[0])
    assert res[1] == {"ok": True, "cached": 12, "blocks": [1, 2, 3, 5]}  # the last block is recomputed
    assert res[2] == {"ok": True, "blocks": [6], "copies": []}
    assert res[3] == {"ok": True, "blocks": [1, 2, 3, 4, 6]}
    assert [r.get("code") for r in res[4:]] == ["unknown_request", "unknown_sub_op"]
    ok(call(srv, "check", sid))


def test_requests_are_scoped_per_session():
    srv, a = ready_server()
    b = hello(srv, role="admin")  # an admin may step on a pool it holds no shard of
    ok(call(srv, "step", a, pool="p", epoch=1, ops=[alloc(1)]))
    res = ok(call(srv, "step", b, pool="p", epoch=1, ops=[{"op": "free", "req": 1}, alloc(1)]))["results"]
    assert res[0]["code"] == "unknown_request" and res[1]["ok"]  # b's request 1 is another request
    assert ok(call(srv, "requests", a, pool="p"))["total"] == 2


def test_step_errors_change_nothing():
    srv, sid = ready_server(max_sub_ops=4)
    before = ok(call(srv, "stats", sid))["pools"]["p"]
    for args, code in [
        ({"pool": "q", "epoch": 1, "ops": []}, "unknown_pool"),
        ({"pool": "p", "epoch": 2, "ops": [alloc(1)]}, "stale_epoch"),
        ({"pool": "p", "epoch": 1, "ops": [alloc(i) for i in range(5)]}, "too_many_sub_ops"),
        ({"pool": "p", "epoch": 1, "ops": {"op": "alloc"}}, "bad_field"),
        ({"pool": "p", "epoch": True, "ops": []}, "bad_field"),
        ({"pool": ["p"], "epoch": 1, "ops": []}, "bad_field"),  # a wrong type is a bad field, not a name
    ]:
        assert call(srv, "step", sid, **args)["status"] == code, args
    assert call(srv, "step", sid, pool="p", epoch=2, ops=[])["body"] == {"epoch": 1}
    after = ok(call(srv, "stats", sid))["pools"]["p"]
    assert after == before


def test_a_pool_of_the_wrong_type_is_a_bad_field_for_every_op_that_names_one():
    srv, sid = ready_server()
    for op, args in [("step", {"epoch": 1, "ops": []}), ("requests", {}), ("evict", {"n": 1}),
                     ("lookup", {"hashes": []})]:
        for bad in (7, ["p"], None, {"p": 1}, b"p"):
            reply = call(srv, op, sid, pool=bad, **args)
            assert reply["status"] == "bad_field" and "'pool'" in reply["msg"], (op, bad, reply)


def test_a_pool_is_not_ready_until_all_shards_register_and_epoch_moves_on_restart():
    srv = make_server()
    sid = hello(srv)
    assert ok(register(srv, sid, count=2))["state"] == "pending"
    assert call(srv, "step", sid, pool="p", epoch=1, ops=[])["status"] == "pool_not_ready"
    assert ok(register(srv, sid, rank=1, count=2, inc="i1", blocks=40)) | {} == {
        "pool": "p", "state": "ready", "epoch": 1, "registered": 2, "shard_count": 2, "num_blocks": 40,
        "block_size": 4, "max_model_len": 1 << 20}
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1)]))
    assert ok(register(srv, sid, rank=1, count=2, inc="i1-restarted", blocks=40))["epoch"] == 2
    assert call(srv, "step", sid, pool="p", epoch=1, ops=[])["status"] == "stale_epoch"
    assert ok(call(srv, "stats", sid))["pools"]["p"]["requests"] == 0
    bad = register(srv, sid, rank=0, count=2, inc="x", spec={**SPEC, "dtype": "float32"})
    assert bad["status"] == "spec_mismatch" and "dtype" in bad["msg"]


@pytest.mark.parametrize("spec_patch", [{"dtype": "int4"}, {"block_size": 0}, {"head_size": 1.5}, {"num_layers": None}])
def test_register_validates_the_spec(spec_patch):
    srv = make_server()
    sid = hello(srv)
    assert register(srv, sid, spec={**SPEC, **spec_patch})["status"] == "bad_field"
    assert ok(call(srv, "pools", sid))["pools"] == []


def test_lookup_and_locate_have_no_side_effects_and_stay_within_a_pool():
    srv, sid = ready_server()
    ok(register(srv, sid, pool="other", blocks=32))
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1, 32)]))
    before = ok(call(srv, "stats", sid))["pools"]
    assert ok(call(srv, "lookup", sid, pool="p", hashes=H))["blocks"] == 8
    assert ok(call(srv, "lookup", sid, pool="other", hashes=H))["blocks"] == 0
    assert ok(call(srv, "locate", sid, hashes=H[:3]))["pools"] == {"p": 3, "other": 0}
    assert call(srv, "lookup", sid, pool="p", hashes=[b"short"])["status"] == "bad_hash"
    assert call(srv, "lookup", sid, pool="p", hashes=H, epoch=5)["status"] == "stale_epoch"
    assert ok(call(srv, "stats", sid))["pools"] == before


def test_admin_key_gates_admin_ops():
    srv = make_server(admin_key="sesame-1234")
    worker = hello(srv, role="worker")
    assert call(srv, "pools", worker)["status"] == "forbidden"
    assert call(srv, "hello", role="admin", admin_key="wrong-key")["status"] == "forbidden"
    admin = hello(srv, role="admin", admin_key="sesame-1234")
    assert ok(call(srv, "pools", admin)) == {"pools": []}
    ok(call(srv, "stats", worker))  # stats is not an admin op


def test_admin_ops_without_a_key_are_open_to_everyone():
    srv, sid = ready_server()
    assert {name for name, (_, _, admin) in OPS.items() if admin} == {
        "pools", "sessions", "requests", "reset_cache", "evict", "drain", "shutdown", "check", "cached_hashes",
        "drop_pool", "attach", "detach", "pin", "unpin", "pins"}
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1, 32)]))
    assert call(srv, "reset_cache", sid, pool="p")["status"] == "in_use"
    assert ok(call(srv, "sessions", sid))["sessions"][0]["requests"] == 1
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[{"op": "free", "req": 1}]))
    assert ok(call(srv, "evict", sid, pool="p", n=3)) == {"evicted": 3}
    assert ok(call(srv, "reset_cache", sid, pool="p")) == {"reset": True}
    assert ok(call(srv, "lookup", sid, pool="p", hashes=H))["blocks"] == 0


def test_drain_refuses_new_allocations_but_serves_frees():
    srv, sid = ready_server()
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1)]))
    assert ok(call(srv, "drain", sid)) == {"draining": True, "requests": 1}
    res = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(2), {"op": "free", "req": 1}]))["results"]
    assert res == [{"ok": False, "code": "draining", "msg": "the manager is draining: no new allocations"},
                   {"ok": True}]
    assert ok(call(srv, "drain", sid, enable=False)) == {"draining": False, "requests": 0}


def test_deregister_frees_the_sessions_requests_and_ends_it():
    srv, sid = ready_server()
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1), alloc(2, 8, [])]))
    assert ok(call(srv, "deregister", sid)) == {"freed": 2}
    assert call(srv, "heartbeat", sid)["status"] == "unknown_session"


def test_silent_sessions_expire_in_the_loop_and_are_counted():
    srv, sid = ready_server(session_timeout_s=1.0)
    live = hello(srv)
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1)], now=100.0))
    ok(call(srv, "heartbeat", live, now=100.9))
    srv._expire(101.5)
    assert srv.stats.sessions_expired == 1 and srv.stats.expired_requests_freed == 1
    assert call(srv, "heartbeat", sid)["status"] == "unknown_session"
    assert ok(call(srv, "check", live))["requests"] == 0


class CountingSink:
    """An event sink that is not the NullSink: the server then builds KV events for it."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int, list]] = []

    def publish(self, pool: str, epoch: int, events: list) -> None:
        self.batches.append((pool, epoch, events))

    def close(self) -> None:
        pass


def test_commit_and_events_run_once_per_iteration_before_replies():
    sink = CountingSink()
    srv = Server(ManagerConfig(endpoint="ipc:///tmp/kvpool-unused.sock"), publisher=sink)
    sid = hello(srv)
    ok(register(srv, sid, blocks=32))
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1, 32)]))
    assert "p" in srv.registry.dirty
    srv._commit()
    assert srv.store.commits == 1 and srv.registry.dirty == set()
    assert [len(events) for _, _, events in sink.batches] == [1]  # one "stored" event for the 7 cached blocks
    assert srv.registry.pools["p"].pool.take_events() == []
    assert srv.stats.events == 1 and srv.stats.event_batches == 1


def test_a_manager_that_publishes_no_events_builds_none():
    srv, sid = ready_server()  # no events_endpoint: nothing could ever receive them
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1, 32)]))
    assert not srv.registry.pools["p"].pool.blocks.events_enabled
    srv._commit()
    assert srv.stats.events == srv.stats.event_batches == 0
    assert ok(call(srv, "lookup", sid, pool="p", hashes=H[:7]))["blocks"] == 7  # cached all the same


def test_an_internal_error_is_answered_and_counted(monkeypatch):
    srv, sid = ready_server()
    monkeypatch.setattr(srv.registry, "total_requests", lambda: 1 / 0)
    assert call(srv, "drain", sid)["status"] == "internal"
    assert srv.stats.errors["internal"] == 1
    assert ok(call(srv, "heartbeat", sid)) == {}


def test_msgpack_ext_types_and_str_hashes_are_refused():
    srv, sid = ready_server()
    ext = msgpack.ExtType(1, b"x" * 32)
    assert call(srv, "lookup", sid, pool="p", hashes=[ext])["status"] == "bad_message"  # refused while decoding
    assert call(srv, "lookup", sid, pool="p", hashes=["a" * 32])["status"] == "bad_hash"


def test_a_sub_op_with_more_hashes_than_max_hashes_is_a_bad_field():
    srv, sid = ready_server(max_message_bytes=16 << 20)
    hashes = [bytes(32)] * (MAX_HASHES + 1)
    res = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[{**alloc(1), "hashes": hashes}]))["results"]
    assert res[0]["code"] == "bad_field" and str(MAX_HASHES) in res[0]["msg"]
    assert ok(call(srv, "stats", sid))["pools"]["p"]["requests"] == 0


def _deep(levels: int) -> list:
    v: list = []
    for _ in range(levels):
        v = [v]
    return v


@pytest.mark.parametrize("dtype", [["float16"], {"float16": 1}, _deep(1000), b"float16", 2])
def test_register_with_a_container_or_deep_dtype_is_bad_field_not_internal(dtype):
    srv = make_server()
    sid = hello(srv)
    reply = register(srv, sid, spec={**SPEC, "dtype": dtype})
    assert reply["status"] == "bad_field" and "dtype" in reply["msg"] and len(reply["msg"]) < 300


@pytest.mark.parametrize("where", ["pool", "epoch", "identity", "op", "req", "prompt_len", "child", "n"])
def test_a_value_nested_1000_deep_in_a_validated_field_is_a_proper_error(where):
    srv, sid = ready_server()
    deep = _deep(1000)
    if where in ("req", "prompt_len", "child"):
        sub = {**alloc(1), where: deep} if where != "child" else {"op": "fork", "req": 1, "child": deep}
        reply = call(srv, "step", sid, pool="p", epoch=1, ops=[sub])
        result = ok(reply)["results"][0]
        assert result["ok"] is False and result["code"] in ("bad_field", "unknown_request"), result
        assert len(result["msg"]) < 300
        return
    if where == "identity":
        reply = call(srv, "hello", identity=deep)
    elif where == "op":
        reply = unpack(srv.handle_payload(pack({"v": 1, "id": 3, "op": deep, "args": {}}), 0.0))
    elif where == "n":
        admin = hello(srv)
        reply = call(srv, "evict", admin, pool="p", n=deep)
    else:
        reply = call(srv, "step", sid, **{"pool": "p", "epoch": 1, "ops": [], where: deep})
    assert reply["status"] in ("bad_field", "unknown_op", "unknown_pool"), reply
    assert srv.stats.errors["internal"] == 0 and len(reply["msg"]) < 300


def test_an_array_of_empty_maps_is_refused_while_decoding_before_it_is_built():
    import tracemalloc

    srv = make_server()
    n = srv.cfg.max_message_bytes - 16
    one_array = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n  # one array of ~8M empty maps
    k = MAX_HASHES  # 63 arrays of k empty maps each: every array within the length limit
    many_arrays = b"\xdc" + (63).to_bytes(2, "big") + (b"\xdd" + k.to_bytes(4, "big") + b"\x80" * k) * 63
    assert len(many_arrays) < srv.cfg.max_message_bytes
    for bomb, why in ((one_array, "exceeds max_array_len"), (many_arrays, "maps and arrays in one message")):
        tracemalloc.start()
        try:
            replies = [unpack(srv.handle_payload(bomb, 0.0)) for _ in range(12)]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert {r["status"] for r in replies} == {"bad_message"} and why in replies[0]["msg"], replies[0]
        assert peak < 16 << 20, f"decoding built {peak >> 20} MiB of objects before refusing"
    nested = pack({"v": 1, "id": 1, "op": "hello", "args": {"x": [[{}] * 4000] * 3}})
    assert unpack(srv.handle_payload(nested, 0.0))["status"] == "bad_message"
    assert ok(call(srv, "hello"))["sid"]  # and a normal message right after is served


def test_extend_with_more_hashes_than_full_blocks_is_refused_as_alloc_is():
    srv, sid = ready_server()
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1, n_tokens=8)]))  # 2 full blocks of 4
    res = ok(call(srv, "step", sid, pool="p", epoch=1,
                  ops=[{"op": "extend", "req": 1, "num_tokens": 9, "hashes": H[2:6]}]))["results"][0]
    assert res["ok"] is False and res["code"] == "bad_hashes", res
    res = ok(call(srv, "step", sid, pool="p", epoch=1,
                  ops=[{"op": "extend", "req": 1, "num_tokens": 12, "hashes": H[2:3]}]))["results"][0]
    assert res["ok"] is True, res
    ok(call(srv, "check", sid))


def test_only_the_pools_shard_sessions_or_an_admin_may_step_on_it_or_register_over_it():
    srv, owner = ready_server()
    other = hello(srv)
    assert call(srv, "step", other, pool="p", epoch=1, ops=[alloc(1)])["status"] == "not_owner"
    taken = register(srv, other, inc="hijack", blocks=32)  # a new incarnation of a live session's shard
    assert taken["status"] == "not_owner" and "replace" in taken["msg"]
    assert ok(call(srv, "pools", owner))["pools"][0]["epoch"] == 1, "the refused registration changed nothing"
    ok(call(srv, "step", owner, pool="p", epoch=1, ops=[alloc(1)]))
    # the same incarnation from a new session (a worker whose session timed out) re-binds the shard
    again = hello(srv)
    assert ok(register(srv, again, blocks=32))["epoch"] == 1
    assert call(srv, "step", owner, pool="p", epoch=1, ops=[])["status"] == "not_owner"
    # an explicit replacement takes the shard over; the old owner is then refused
    body = ok(call(srv, "register", other, pool="p", shard_rank=0, shard_count=1, incarnation="new", spec=SPEC,
                   available_kv_bytes=kv_bytes(32), replace=True))
    assert body["epoch"] == 2
    assert register(srv, again, inc="i0-restarted", blocks=32)["status"] == "not_owner"
    admin = hello(srv, role="admin")
    ok(call(srv, "step", admin, pool="p", epoch=2, ops=[alloc(1)]))
    ok(call(srv, "deregister", other))  # a pool whose shards' sessions are gone is anyone's
    assert ok(register(srv, again, inc="i0-after", blocks=32))["epoch"] == 3
    assert call(srv, "register", again, pool="p", shard_rank=0, shard_count=1, incarnation="x", spec=SPEC,
                available_kv_bytes=kv_bytes(32), replace="yes")["status"] == "bad_field"
    ok(call(srv, "check", admin))


def test_a_worker_role_is_no_admin_for_ownership_even_without_an_admin_key():
    srv, owner = ready_server()  # no admin key: every session may run admin ops ...
    intruder = hello(srv, role="worker")
    assert ok(call(srv, "pools", intruder))["pools"]  # ... but owning a pool needs a shard or role admin
    assert call(srv, "step", intruder, pool="p", epoch=1, ops=[])["status"] == "not_owner"


def test_registrations_beyond_the_session_and_total_block_quotas_are_refused():
    srv = make_server(max_session_blocks=100, max_total_blocks=150)
    a, b = hello(srv), hello(srv)
    ok(register(srv, a, pool="p1", blocks=60))
    over = register(srv, a, pool="p2", blocks=41)
    assert over["status"] == "quota_exceeded" and "max_session_blocks" in over["msg"]
    ok(register(srv, a, pool="p2", blocks=40))
    ok(register(srv, a, pool="p1", inc="i1", blocks=60))  # re-registering its own shard counts once
    over = register(srv, b, pool="p3", blocks=51)
    assert over["status"] == "quota_exceeded" and "max_total_blocks" in over["msg"]
    ok(register(srv, b, pool="p3", blocks=50))
    assert sorted(p["pool"] for p in ok(call(srv, "pools", a))["pools"]) == ["p1", "p2", "p3"]


def test_tokens_per_sub_op_are_bounded_by_the_pools_declared_max_model_len():
    srv = make_server()
    sid = hello(srv)
    body = ok(register(srv, sid, blocks=64, spec={**SPEC, "max_model_len": 64}))
    assert body["max_model_len"] == 64
    for sub in ({**alloc(1), "prompt_len": 65, "max_new": 1}, {**alloc(1), "lookahead": 65},
                {"op": "extend", "req": 1, "num_tokens": 65}):
        reply = call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(9), sub])
        assert reply["status"] == "bad_field" and "max_model_len" in reply["msg"], reply
    assert ok(call(srv, "stats", sid))["pools"]["p"]["requests"] == 0, "a refused step runs no sub-op"
    assert register(srv, sid, pool="q", spec={**SPEC, "max_model_len": (1 << 20) + 1})["status"] == "bad_field"


def test_the_blocks_one_step_may_hand_out_or_share_are_bounded():
    srv = make_server(max_step_blocks=40)
    sid = hello(srv)
    ok(register(srv, sid, blocks=1000))
    # block_size 4: each alloc of 16 tokens may take 4 blocks (+1 margin): 8 fit, 9 do not
    assert ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(r, hashes=[]) for r in range(8)]))
    reply = call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(r, hashes=[]) for r in range(8, 17)])
    assert reply["status"] == "step_too_large" and "max_step_blocks" in reply["msg"]
    # growth within one step is projected: admit small, then extend and fork it in the same message
    grow = [alloc(100, n_tokens=4, hashes=[]), {"op": "extend", "req": 100, "num_tokens": 160}]
    assert call(srv, "step", sid, pool="p", epoch=1, ops=grow)["status"] == "step_too_large"
    forks = [{"op": "fork", "req": 0, "child": 200 + i} for i in range(9)]  # 4 blocks shared each
    assert call(srv, "step", sid, pool="p", epoch=1, ops=forks + [alloc(300, hashes=[])])["status"] == "step_too_large"
    assert ok(call(srv, "stats", sid))["pools"]["p"]["requests"] == 8


def test_an_extend_with_a_base_runs_only_on_the_tokens_it_was_built_on():
    """A pipelined worker sends step N+1 before it knows step N's answers: ``base`` says which
    num_tokens step N left, so a refused step N makes step N+1 refuse too, changing nothing."""
    srv, sid = ready_server()
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[alloc(1)]))  # 16 tokens, 4 blocks
    before = ok(call(srv, "stats", sid))["pools"]["p"]
    stale = {"op": "extend", "req": 1, "num_tokens": 18, "hashes": [H[4]], "base": 17}
    res = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[stale]))["results"]
    assert res[0]["code"] == "stale_base" and "holds 16 tokens, not base 17" in res[0]["msg"]
    assert ok(call(srv, "stats", sid))["pools"]["p"] == before
    good = [{"op": "extend", "req": 1, "num_tokens": 17, "base": 16},
            {"op": "extend", "req": 1, "num_tokens": 18, "base": 17},
            {"op": "extend", "req": 2, "num_tokens": 3, "base": 0}]  # no such request: unknown
    res = ok(call(srv, "step", sid, pool="p", epoch=1, ops=good))["results"]
    assert [r.get("code") for r in res] == [None, None, "unknown_request"] and res[0]["blocks"] == [5]
    ok(call(srv, "check", sid))


def test_a_served_name_carries_its_tokenizer_path_to_the_workers_rows():
    srv = make_server()
    sid = hello(srv)
    serve = {"endpoint": "ipc:///tmp/w.sock", "model": "my-model", "max_model_len": 512}
    for bad in (5, "", "x" * 4097, ["/ckpt"]):
        reply = call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                     available_kv_bytes=kv_bytes(32), serve={**serve, "tokenizer": bad})
        assert reply["status"] == "bad_field" and "serve.tokenizer" in reply["msg"], bad
    ok(call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
            available_kv_bytes=kv_bytes(32), serve={**serve, "tokenizer": "/ckpt"}))
    (row,) = ok(call(srv, "workers", sid))["workers"]
    assert (row["model"], row["tokenizer"]) == ("my-model", "/ckpt")
