"""The Redis store against the real Redis: commit, recover, compaction, async, fencing, outages,
URLs, and `kvpool snapshot` / `kvpool restore`."""

from __future__ import annotations

import random
import time

import pytest
from click.testing import CliRunner
from helpers.durable import (
    REDIS_URL,
    call,
    drop_namespace,
    durable_server,
    new_namespace,
    pending,
    random_step,
    redis_or_skip,
    settle,
    state_of,
)
from helpers.manager import SPEC, kv_bytes, ok

from kvpool.cli.main import cli
from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.store.redis_store import namespace_keys
from kvpool.manager.store.redis_url import parse_redis_url
from kvpool.shared.protocol import unpack

EP = "ipc:///tmp/kvpool-store-test.sock"


@pytest.fixture
def ns():
    r = redis_or_skip()
    name = new_namespace()
    yield r, name
    drop_namespace(r, name)
    r.close()


def server(name: str, endpoint: str = EP, **cfg):
    cfg.setdefault("lease_ms", 1000)
    cfg.setdefault("redis_timeout_s", 0.5)
    return durable_server(endpoint, redis_url=REDIS_URL, namespace=name, **cfg)


def workload(srv, steps: int, seed: int = 0, snapshots_done: bool = False) -> str:
    """``snapshots_done``: wait for each background snapshot (a forked child) before going on."""
    rng = random.Random(seed)
    sid = ok(call(srv, "hello"))["sid"]
    ok(call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
            available_kv_bytes=kv_bytes(80)))
    alive, rid = [], [0]
    for i in range(steps):
        ops = random_step(rng, alive, rid)
        settle(ok(call(srv, "step", sid, pool="p", epoch=1, ops=ops))["results"], ops, alive)
        if i % 10 == 9:
            ok(call(srv, "evict", sid, pool="p", n=2))
        assert srv._commit([]) == [] and srv.mode == "active"
        if snapshots_done:
            srv.store.wait_for_snapshot()
    return sid


@pytest.mark.redis
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_restarted_manager_recovers_the_exact_state(ns, durability):
    r, name = ns
    srv = server(name, durability=durability, snapshot_bytes=4096)  # several compactions
    workload(srv, 80, snapshots_done=True)
    if durability == "async":
        srv.store._writer.flush()
    srv.store.wait_for_snapshot()  # compactions run in a forked child (snapshot_child.py)
    stats = srv.store.stats()
    assert stats["snapshots"] >= 3 and stats["failures"] == 0 and stats["snapshot_failures"] == 0, str(stats)
    assert r.llen(namespace_keys(name)["journal"]) == stats["seq"] - stats["snapshot_seq"]
    back = server(name)  # same endpoint: the same owner takes its lease back at once
    assert back.mode == "active" and state_of(back.registry) == state_of(srv.registry)
    assert ok(call(back, "check", next(iter(back.registry.sessions))))["requests"] == \
        srv.registry.total_requests()


@pytest.mark.redis
def test_a_clean_shutdown_snapshots_and_releases_the_lease(ns):
    r, name = ns
    srv = server(name)
    workload(srv, 10)
    srv.close()
    keys = namespace_keys(name)
    assert r.llen(keys["journal"]) == 0 and not r.exists(keys["lease"])
    other = server(name, endpoint="ipc:///tmp/kvpool-store-other.sock")  # another owner: the lease is free
    assert other.mode == "active" and state_of(other.registry) == state_of(srv.registry)


@pytest.mark.redis
def test_a_standby_waits_and_an_old_active_is_fenced(ns):
    r, name = ns
    active = server(name)
    sid = workload(active, 5)
    standby = server(name, endpoint="ipc:///tmp/kvpool-store-standby.sock")
    assert standby.mode == "standby"
    assert call(standby, "heartbeat", sid)["status"] == "not_active"
    time.sleep(1.1)  # the active one is "paused": its lease runs out
    standby._activate(time.monotonic())
    assert standby.mode == "active" and state_of(standby.registry) == state_of(active.registry)
    assert call(standby, "heartbeat", sid)["status"] == "ok"
    # the old active wakes up: its next commit is refused, it acknowledges nothing and stops
    answer = pending(active, "step", sid, pool="p", epoch=1, ops=[{"op": "alloc", "req": 999, "hashes": [],
                                                                   "prompt_len": 4, "max_new": 4}])
    reply = unpack(answer.encode())
    assert reply["status"] == "ok"  # handled, but not yet sent: the commit decides
    frames = active._commit([answer])
    assert active.mode == "fenced" and active.exit_code == 75 and active._stop
    assert unpack(frames[0][1])["status"] == "not_active"
    assert all(999 not in {k[1] for k in e.pool.requests} for e in standby.registry.pools.values())


@pytest.mark.redis
def test_redis_unreachable_means_errors_and_no_acknowledgement(ns):
    _, name = ns
    srv = durable_server(EP, redis_url="redis://127.0.0.1:1/0", namespace=name, lease_ms=1000,
                         redis_timeout_s=0.2)
    assert srv.mode == "recovering"
    reply = call(srv, "hello")
    assert reply["status"] == "store_unavailable" and "Redis" in reply["msg"]


@pytest.mark.redis
def test_a_corrupt_state_in_redis_is_refused(ns):
    r, name = ns
    srv = server(name)
    workload(srv, 5)
    keys = namespace_keys(name)
    r.lset(keys["journal"], 1, b"J\x00\x00\x00\x00garbage")
    with pytest.raises(CorruptState, match="checksum"):
        server(name)
    r.delete(keys["snap"])
    with pytest.raises(CorruptState, match="without a snapshot"):
        server(name)


def test_redis_urls():
    assert parse_redis_url("redis://h:1/2").kind == "standalone"
    assert parse_redis_url("unix:///run/redis.sock").kind == "standalone"
    t = parse_redis_url("redis+sentinel://:pw@s1:26379,s2:26380/mymaster/3")
    assert (t.kind, t.hosts, t.service, t.db, t.password) == ("sentinel", [("s1", 26379), ("s2", 26380)],
                                                             "mymaster", 3, "pw")
    t = parse_redis_url("redis+cluster://a:7000,b:7001")
    assert (t.kind, t.hosts) == ("cluster", [("a", 7000), ("b", 7001)])
    for bad in ("http://x:1", "redis+sentinel://s1:26379", "redis+cluster://a:7000/1", "redis+sentinel://s1/m",
                "redis+cluster://"):
        with pytest.raises(ValueError):
            parse_redis_url(bad)
    assert namespace_keys("ns")["journal"] == "kvpool:{ns}:journal"  # one hash tag: one Cluster slot


@pytest.mark.redis
def test_snapshot_to_a_file_and_restore(ns, tmp_path):
    r, name = ns
    srv = server(name)
    workload(srv, 20)
    path = str(tmp_path / "state.kvps")
    run = CliRunner().invoke
    res = run(cli, ["snapshot", "--redis-url", REDIS_URL, "--namespace", name, "-o", path])
    assert res.exit_code == 0, res.output
    assert "invariants hold" in res.output and "pool p" in res.output
    res = run(cli, ["restore", path, "--redis-url", REDIS_URL, "--namespace", name])
    assert res.exit_code == 1 and "holds the lease" in res.output  # the manager is running
    target = new_namespace()
    try:
        res = run(cli, ["restore", path, "--redis-url", REDIS_URL, "--namespace", target, "--keep-state-id"])
        assert res.exit_code == 0, res.output
        moved = server(target)
        assert state_of(moved.registry) == state_of(srv.registry)
        moved.close()
    finally:
        drop_namespace(r, target)
    res = run(cli, ["restore", path, "--redis-url", REDIS_URL, "--namespace", name, "--force"])
    assert res.exit_code == 0, res.output
    ok(call(srv, "hello"))  # the running manager serves until its next write...
    srv._commit([])
    assert srv.mode == "fenced"  # ...which the restore fenced out
    (tmp_path / "bad.kvps").write_bytes(open(path, "rb").read()[:-3])
    res = run(cli, ["snapshot", "--input", str(tmp_path / "bad.kvps")])
    assert res.exit_code == 1 and "corrupt state" in res.output


@pytest.mark.redis
def test_an_async_write_failure_stops_acknowledging_and_recovers(ns):
    from kvpool.manager.store.base import StoreUnavailable

    _, name = ns
    srv = server(name, durability="async")
    sid = workload(srv, 5)
    writer = srv.store._writer
    writer.flush()  # everything so far reached Redis

    def down(first_seq, blobs):
        raise StoreUnavailable("Redis went away")

    writer._write_blobs = down
    ok(call(srv, "step", sid, pool="p", epoch=1, ops=[{"op": "alloc", "req": 77, "hashes": [],
                                                      "prompt_len": 4, "max_new": 4}]))
    assert srv._commit([]) == []  # queued: acknowledged (the documented async loss window)
    writer.flush()
    reply = pending(srv, "heartbeat", sid)
    frames = srv._commit([reply])  # the writer's failure surfaces at the next commit
    assert srv.mode == "recovering" and unpack(frames[0][1])["status"] == "store_unavailable"
    assert call(srv, "heartbeat", sid)["status"] == "store_unavailable"
    old = srv.registry.state_id
    srv._activate(time.monotonic())  # Redis answers again: what it holds lacks the acknowledged alloc 77...
    assert srv.mode == "active" and srv.store.counts["start_overs"] == 1
    assert srv.registry.state_id != old and srv.registry.pools == {}  # ...so it is served as a new, empty state
    reply = call(srv, "heartbeat", sid)
    assert reply["status"] == "unknown_session" and reply["state"] == srv.registry.state_id


@pytest.mark.redis
def test_a_failed_background_snapshot_loses_nothing_and_is_retried(ns):
    from kvpool.manager.store.redis_url import connect

    r, name = ns
    srv = server(name, snapshot_bytes=4096)
    store = srv.store
    good = store.compaction._reconnect
    store.compaction._reconnect = lambda: connect("redis://127.0.0.1:1/0", 0.2)  # the child cannot reach Redis
    workload(srv, 30, snapshots_done=True)
    assert store.counts["snapshot_failures"] >= 1 and store.counts["snapshots"] == 1  # only the first one
    assert r.llen(namespace_keys(name)["journal"]) == store.seq  # the journal still holds every batch
    store.compaction._reconnect = good
    workload(srv, 30, seed=1, snapshots_done=True)
    assert store.counts["snapshots"] >= 2
    assert r.llen(namespace_keys(name)["journal"]) == store.seq - store.snap_seq
    back = server(name)
    assert state_of(back.registry) == state_of(srv.registry)
    back.close()


@pytest.mark.redis
def test_a_clean_stop_under_async_proves_nothing_was_lost(ns, tmp_path):
    """Async without this host's mark (as on another host): a clean stop's marker lets the next
    manager serve the same state; after a kill it could not know, and starts a new one."""
    _, name = ns
    srv = server(name, durability="async", high_water_file=str(tmp_path / "a.seq"))
    workload(srv, 10)
    state = srv.registry.state_id
    srv.close()  # a clean stop: flush, snapshot, release with the clean marker
    back = server(name, durability="async", high_water_file=str(tmp_path / "b.seq"))
    assert back.registry.state_id == state and back.store.counts["start_overs"] == 0
    workload(back, 5, seed=2)
    back.store._writer.flush()
    back.store._stop_writer()  # killed: no clean stop (the lease is taken over below, same owner)
    again = server(name, durability="async", high_water_file=str(tmp_path / "c.seq"))
    assert again.registry.state_id != state and again.store.counts["start_overs"] == 1
    again.close()


@pytest.mark.redis
def test_a_pool_recovered_without_a_subscriber_socket_builds_no_events(ns):
    """No events_endpoint: no KV events on any path, a pool loaded from Redis included (the
    store loads it with events on; the daemon's switch turns them off before the restatement)."""
    _r, name = ns
    srv = server(name, snapshot_bytes=4096)
    sid = workload(srv, 30, snapshots_done=True)
    assert not srv.registry.pools["p"].pool.events_enabled  # fresh: none
    srv.store.wait_for_snapshot()
    back = server(name)
    pool = back.registry.pools["p"].pool
    assert back.mode == "active" and pool.blocks.cached and not pool.events_enabled
    ok(call(back, "evict", sid, pool="p", n=1))
    assert back._commit([]) == []
    assert pool.take_events() == [] and back.stats.events == back.stats.event_batches == 0


@pytest.mark.redis
def test_a_slow_recovery_gives_every_session_a_full_timeout_from_when_serving_starts(ns, monkeypatch):
    from kvpool.manager.store.redis_store import RedisStore

    _, name = ns
    srv = server(name)
    sid = workload(srv, 10)
    srv.close()
    real_load = RedisStore.load

    def slow_load(self, registry, now):  # as a load of millions of blocks takes seconds
        out = real_load(self, registry, now)
        time.sleep(1.5)
        return out

    monkeypatch.setattr(RedisStore, "load", slow_load)
    back = server(name, session_timeout_s=1.0)
    assert back.mode == "active" and sid in back.registry.sessions
    assert back.registry.expire(time.monotonic()) == []  # the load's 1.5 s did not count
    assert ok(call(back, "stats", sid))  # the session serves
