"""Pool health: whether a live worker session backs every shard; idle pools; `drop-pool`."""

from __future__ import annotations

import json

from click.testing import CliRunner
from helpers.durable import CaptureStore, durable_server, state_of
from helpers.manager import SPEC, call, hello, kv_bytes, ok, register, wait_until

from kvpool.cli.admin import EXIT_UNHEALTHY
from kvpool.cli.main import cli
from kvpool.client.manager import ManagerClient


def health(srv, sid) -> dict:
    return {p["pool"]: (p["health"], p["live_shards"]) for p in ok(call(srv, "pools", sid))["pools"]}


def test_a_dead_worker_makes_its_pool_lost_a_clean_stop_idle():
    srv = durable_server(store=CaptureStore())
    admin, a, b = hello(srv), hello(srv), hello(srv)
    ok(register(srv, a, pool="a"))
    ok(register(srv, b, pool="b"))
    assert health(srv, admin) == {"a": ("ok", 1), "b": ("ok", 1)}
    ok(call(srv, "deregister", a))  # clean stop
    now = srv.registry.sessions[b].last_seen
    srv.registry.sessions[admin].last_seen = now + 100
    srv._expire(now + 60)  # b died: its session expires
    assert health(srv, admin) == {"a": ("idle", 0), "b": ("lost", 0)}
    stats = ok(call(srv, "stats", admin))["pools"]
    assert stats["b"]["health"] == "lost" and stats["b"]["dead_shards"] == [0]
    ok(register(srv, hello(srv), pool="b", inc="i1"))  # the worker came back
    assert health(srv, admin)["b"] == ("ok", 1)


def test_a_cleanly_stopped_two_shard_pool_is_idle_and_a_half_dead_one_waiting():
    srv = durable_server(store=CaptureStore())
    admin, r0, r1 = hello(srv), hello(srv), hello(srv)
    ok(register(srv, r0, rank=0, count=2))
    ok(register(srv, r1, rank=1, count=2))
    assert health(srv, admin) == {"p": ("ok", 2)}
    ok(call(srv, "deregister", r1))
    assert health(srv, admin) == {"p": ("waiting", 1)}
    ok(call(srv, "deregister", r0))
    assert health(srv, admin) == {"p": ("idle", 0)}


def test_drop_pool_is_refused_while_a_live_worker_holds_it_and_survives_a_restart():
    store = CaptureStore()
    srv = durable_server(store=store)
    admin, w = hello(srv), hello(srv)
    ok(register(srv, w, pool="gone"))
    ok(register(srv, w, pool="kept"))
    ok(call(srv, "step", w, pool="gone", epoch=1,
            ops=[{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 9, "max_new": 9}]))
    assert call(srv, "drop_pool", admin, pool="gone")["status"] == "in_use"
    assert call(srv, "drop_pool", admin, pool="nope")["status"] == "unknown_pool"
    assert ok(call(srv, "drop_pool", admin, pool="gone", force=True)) == {"pool": "gone", "dropped": True,
                                                                         "freed": 1}
    assert sorted(srv.registry.pools) == ["kept"]
    srv.registry.check_invariants()
    srv._commit([])
    back = durable_server(store=store)  # the journal replays the drop and how sessions ended
    assert state_of(back.registry) == state_of(srv.registry)
    assert call(srv, "step", w, pool="gone", epoch=1, ops=[])["status"] == "unknown_pool"


def test_journal_replays_how_a_session_ended():
    store = CaptureStore()
    srv = durable_server(store=store)
    admin, w = hello(srv), hello(srv)
    ok(register(srv, w))
    srv.registry.sessions[admin].last_seen += 100
    srv._expire(srv.registry.sessions[w].last_seen + 60)
    srv._commit([])
    back = durable_server(store=store)
    assert health(back, admin) == {"p": ("lost", 0)}


def run(endpoint: str, *args: str, code: int = 0) -> str:
    res = CliRunner().invoke(cli, [*args], env={"KVPOOL_MANAGER": endpoint}, catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res.output


def test_status_pool_fails_for_a_dead_worker_and_drop_pool_clears_it(live_server):
    live = live_server(session_timeout_s=0.6)
    ep = live.endpoint
    worker = ManagerClient(ep, identity="worker-a")
    worker.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC, available_kv_bytes=kv_bytes(40))
    try:
        assert "healthy" in run(ep, "status", "--pool", "p")
        assert "in_use" in run(ep, "drop-pool", "p", code=1)
        out = run(ep, "pools")
        assert out.splitlines()[1].split()[:6] == ["p", "ready", "ok", "1", "1/1", "1/1"]
        wait_until(lambda: "lost" in run(ep, "pools"), 10, "the silent worker's session to expire")
        out = run(ep, "status", "--pool", "p", code=EXIT_UNHEALTHY)
        assert "worker died" in out and "kvpool drop-pool" in out
        assert json.loads(run(ep, "drop-pool", "p", "--json"))["dropped"] is True
        assert "healthy" in run(ep, "status")
        assert "no pool p" in run(ep, "status", "--pool", "p", code=EXIT_UNHEALTHY)
    finally:
        worker.close()


def test_status_is_healthy_when_workers_left_cleanly_but_not_for_their_pool(live_server):
    live = live_server()
    ep = live.endpoint
    with ManagerClient(ep, identity="worker-a") as worker:
        worker.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                        available_kv_bytes=kv_bytes(40))
    assert "healthy" in run(ep, "status")
    assert "no live worker" in run(ep, "status", "--pool", "p", code=EXIT_UNHEALTHY)
    assert "dropped" in run(ep, "drop-pool", "p")


def test_a_second_worker_for_a_live_shard_is_refused_unless_it_replaces():
    store = CaptureStore()
    srv = durable_server(store=store)
    first, second = hello(srv), hello(srv)
    assert ok(register(srv, first, inc="i0"))["epoch"] == 1
    refused = register(srv, second, inc="i1")
    assert refused["status"] == "not_owner" and "replace: true" in refused["msg"]
    assert call(srv, "register", second, pool="p", shard_rank=0, shard_count=1, incarnation="i1", spec=SPEC,
                available_kv_bytes=kv_bytes(64), replace="yes")["status"] == "bad_field"
    taken = ok(call(srv, "register", second, pool="p", shard_rank=0, shard_count=1, incarnation="i1", spec=SPEC,
                    available_kv_bytes=kv_bytes(64), replace=True))
    assert taken["epoch"] == 2
    assert register(srv, first, inc="i0")["status"] == "not_owner"  # the replaced worker cannot take it back
    srv._commit([])
    assert state_of(durable_server(store=store).registry) == state_of(srv.registry)
    ok(call(srv, "deregister", second))
    assert ok(register(srv, first, inc="i2"))["epoch"] == 3  # nobody holds it: no replace needed


def test_the_generate_diagnosis_names_what_the_manager_knows(live_server, sock_dir):
    from kvpool.worker.diagnose import pool_diagnosis

    live = live_server(session_timeout_s=0.6)
    assert "knows no pool 'p'" in pool_diagnosis(live.endpoint, "p")
    worker = ManagerClient(live.endpoint, identity="w")
    worker.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC, available_kv_bytes=kv_bytes(40))
    assert "still sees a live worker" in pool_diagnosis(live.endpoint, "p")
    wait_until(lambda: "died" in pool_diagnosis(live.endpoint, "p"), 10, "the worker's session to expire")
    worker.close()
    assert "does not answer either" in pool_diagnosis(f"ipc://{sock_dir}/none.sock", "p", timeout_s=0.3)
