"""register's optional ``serve`` field and the ``workers`` op: how front doors find workers."""

from __future__ import annotations

from helpers.durable import CaptureStore, durable_server
from helpers.manager import SPEC, call, hello, kv_bytes, make_server, ok

SERVE = {"endpoint": "ipc:///tmp/w0.sock", "model": "tiny", "max_model_len": 512}


def register(srv, sid, pool="p", serve=None, rank=0, count=1, inc="i0"):
    args = dict(pool=pool, shard_rank=rank, shard_count=count, incarnation=inc, spec=SPEC,
                available_kv_bytes=kv_bytes(32))
    if serve is not None:
        args["serve"] = serve
    return call(srv, "register", sid, **args)


def test_workers_lists_ready_pools_that_announced_an_endpoint():
    srv = make_server()
    a, b = hello(srv), hello(srv)
    ok(register(srv, a, "served", SERVE))
    ok(register(srv, b, "silent"))  # registered without serve: not a generate endpoint
    rows = ok(call(srv, "workers", a))["workers"]
    assert [(r["pool"], r["endpoint"], r["model"], r["max_model_len"]) for r in rows] == \
        [("served", SERVE["endpoint"], "tiny", 512)]
    assert rows[0]["num_blocks"] == 32 and rows[0]["free_blocks"] == 31 and rows[0]["requests"] == 0
    assert rows[0]["block_size"] == SPEC["block_size"] and rows[0]["epoch"] == 1


def test_a_pending_pool_and_a_gone_session_are_not_listed():
    srv = make_server()
    a, b = hello(srv), hello(srv)
    ok(register(srv, a, "tp", SERVE, rank=0, count=2))
    assert ok(call(srv, "workers", b))["workers"] == []  # the other shard is missing
    c = hello(srv)
    ok(register(srv, c, "tp", None, rank=1, count=2, inc="i1"))
    assert [r["pool"] for r in ok(call(srv, "workers", b))["workers"]] == ["tp"]
    ok(call(srv, "deregister", a))
    assert ok(call(srv, "workers", b))["workers"] == []


def test_a_bad_serve_field_is_refused_and_changes_nothing():
    srv = make_server()
    sid = hello(srv)
    for bad in ["x", {**SERVE, "endpoint": "http://x"}, {**SERVE, "model": ""}, {**SERVE, "max_model_len": 1},
                {**SERVE, "max_model_len": "512"}]:
        reply = register(srv, sid, "p", bad)
        assert reply["status"] == "bad_field" and "serve" in reply["msg"], reply
    assert srv.registry.pools == {}


def test_serve_survives_journal_replay_and_snapshots():
    store = CaptureStore()
    srv = durable_server(store=store)
    sid = ok(call(srv, "hello"))["sid"]
    ok(register(srv, sid, "p", SERVE))
    srv._commit([])
    back = durable_server(store=store)
    assert ok(call(back, "workers", sid))["workers"][0]["endpoint"] == SERVE["endpoint"]
    store.compact(srv.registry)
    again = durable_server(store=store)
    assert ok(call(again, "workers", sid))["workers"][0]["model"] == "tiny"
