"""No silent rollback (PROTOCOL.md section 11): acknowledged state carries a commit sequence;
a state older than one acknowledged is never served as the same state.

Unit tests of the decision and the host's mark; the manager in this process on the real Redis
with keys put back from an older DUMP; then real processes: SIGKILLs of an async manager under
load (with its private Redis paused, so acknowledged batches are surely lost), and a shared
Redis restored from an older copy while the manager was down, with and without the host's mark.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from helpers.durable import (
    Daemon,
    call,
    chaos_clients,
    dump_keys,
    durable_server,
    finish_chaos_clients,
    put_back,
    redis_or_skip,
    redis_server,
)
from helpers.manager import SPEC, kv_bytes, ok, wait_until

from kvpool.client.manager import ManagerClient, ManagerRestarted
from kvpool.manager.store.high_water import HighWater, Mark, start_over_reason
from kvpool.shared.protocol import encode_request, unpack


def alloc(rid: int) -> list[dict]:
    return [{"op": "alloc", "req": rid, "hashes": [], "prompt_len": 10, "max_new": 10}]


def test_start_over_reason():
    assert start_over_reason("s", 5, [Mark("s", 5)], None, "sync") is None
    assert start_over_reason("s", 5, [Mark("s", 3), None], None, "sync") is None  # another host went further
    assert start_over_reason("s", 5, [Mark("other", 9)], None, "sync") is None  # a mark of another state
    assert "batch 7 was acknowledged" in start_over_reason("s", 5, [None, Mark("s", 7)], None, "sync")
    assert start_over_reason("s", 5, [Mark("s", 5)], None, "async") is None  # this host's mark proves it
    assert start_over_reason("s", 5, [], 5, "async") is None  # a clean stop at 5 proves it
    assert "without a clean shutdown" in start_over_reason("s", 5, [Mark("s", 4)], 4, "async")
    assert "without a clean shutdown" in start_over_reason("s", 5, [], None, "async")


def test_high_water_mark_file(tmp_path):
    path = str(tmp_path / "sub" / "ns.seq")
    hw = HighWater(path)
    assert hw.read() is None
    hw.note("a" * 32, 7)
    hw.note("b" * 32, 1 << 40)
    assert HighWater(path).read() == Mark("b" * 32, 1 << 40)
    assert os.stat(path).st_mode & 0o777 == 0o600
    hw.close()
    Path(path).write_bytes(b"short")
    assert HighWater(path).read() is None  # foreign or truncated: nothing known
    assert HighWater(None).read() is None
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    planted = tmp_path / "sub" / "planted.seq"
    planted.symlink_to(target)
    with pytest.raises(OSError):  # a link planted at the path is never followed
        HighWater(str(planted)).note("c" * 32, 1)
    assert target.read_bytes() == b"keep" and HighWater(str(planted)).read() is None


def hello_and_register(srv) -> str:
    sid = ok(call(srv, "hello"))["sid"]
    ok(call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
            available_kv_bytes=kv_bytes(64)))
    srv._commit([])
    return sid


def steps(srv, sid: str, rids: range) -> None:
    for rid in rids:
        ok(call(srv, "step", sid, pool="p", epoch=1, ops=alloc(rid)))
        srv._commit([])


@pytest.mark.redis
def test_a_running_manager_whose_redis_went_back_serves_a_new_state(namespace, tmp_path):
    r = redis_or_skip()
    srv = durable_server(redis_url="redis://127.0.0.1:6379/0", namespace=namespace,
                         high_water_file=str(tmp_path / "hw.seq"))
    sid = hello_and_register(srv)
    copy = dump_keys(r, namespace)
    steps(srv, sid, range(3))
    state = srv.registry.state_id
    put_back(r, namespace, copy)  # under the running manager
    call(srv, "step", sid, pool="p", epoch=1, ops=alloc(9))
    assert srv._commit([]) == [] and srv.mode == "recovering"  # its next commit finds an older journal
    srv._activate(time.monotonic())
    assert srv.mode == "active" and srv.registry.state_id != state and srv.registry.pools == {}
    assert srv.store.counts["start_overs"] == 1
    srv.close()


@pytest.mark.redis
def test_a_client_that_saw_more_commits_makes_the_manager_start_over(namespace, tmp_path):
    """A manager without this host's mark (another host) loads an older copy under the same state
    id: the first request whose ``seq`` is beyond it acknowledges nothing, and the reload serves
    a new state."""
    r = redis_or_skip()
    srv = durable_server(redis_url="redis://127.0.0.1:6379/0", namespace=namespace,
                         high_water_file=str(tmp_path / "a.seq"))
    sid = hello_and_register(srv)
    copy = dump_keys(r, namespace)
    steps(srv, sid, range(3))
    seen, state = srv.registry.seq, srv.registry.state_id
    srv.close()
    put_back(r, namespace, copy)
    other = durable_server(redis_url="redis://127.0.0.1:6379/0", namespace=namespace,
                           high_water_file=str(tmp_path / "b.seq"))
    assert other.registry.state_id == state and other.registry.seq < seen  # it cannot know by itself
    reply = unpack(other.handle_payload(encode_request(1 << 30, "step", sid, {"pool": "p", "epoch": 1,
                                                                                "ops": alloc(7)}, seen),
                                        time.monotonic()))
    assert reply["status"] == "store_unavailable"  # nothing acknowledged on the older state
    assert (sid, 7) not in other.registry.pools["p"].pool.requests  # refused before it ran
    assert other._commit([]) == [] and other.mode == "recovering"
    other._activate(time.monotonic())
    assert other.mode == "active" and other.registry.state_id != state and other.registry.pools == {}
    reply = unpack(other.handle_payload(encode_request(1 << 31, "heartbeat", sid, {}, seen), time.monotonic()))
    assert reply["status"] == "unknown_session" and reply["state"] == other.registry.state_id
    other.close()


@pytest.mark.slow
@pytest.mark.redis
def test_a_redis_restored_from_an_older_copy_is_never_served_as_the_same_state(procs, sock_dir, namespace):
    r = redis_or_skip()
    mark = Path(sock_dir) / "hw.seq"
    d = Daemon(procs, sock_dir, namespace, high_water_file=str(mark))
    d.start()
    d.wait_active()
    c = ManagerClient(d.endpoint, identity="rollback", timeout_s=0.5, failover_s=30.0)
    for round_, keep_mark in enumerate((True, False)):
        epoch = c.register("p", shard_rank=0, shard_count=1, incarnation="w", spec=SPEC,
                           available_kv_bytes=kv_bytes(64))["epoch"]
        c.step("p", epoch, alloc(100 * round_))
        copy = dump_keys(r, namespace)
        for rid in range(1, 4):
            c.step("p", epoch, alloc(100 * round_ + rid))
        state = c.state_id
        d.kill()
        put_back(r, namespace, copy)
        if not keep_mark:  # as on another host: the client's own commit sequence must tell
            mark.unlink()
        d.start()
        with pytest.raises(ManagerRestarted):
            c.step("p", epoch, alloc(100 * round_ + 50))
        assert c.state_id != state  # a new state: the lost allocations are never served as held
        rows = c.call("requests", pool="p", block_ids=True)["requests"] if "p" in c.call("pools")["pools"] else []
        assert rows == []
    c.call("check")
    c.close()


@pytest.mark.slow
def test_async_kills_tell_every_client_whose_acks_were_lost(procs, sock_dir, tmp_path):
    redis_proc, port = redis_server(procs, str(tmp_path))
    daemon = Daemon(procs, sock_dir, "async-chaos", redis_url=f"redis://127.0.0.1:{port}/0", durability="async",
                    high_water_file=f"{sock_dir}/hw.seq", snapshot_bytes=64 << 10)
    daemon.start()
    daemon.wait_active()
    stop = Path(sock_dir) / "stop"
    clients = chaos_clients(procs, daemon.endpoint, stop, 3, "1")
    admin = ManagerClient(daemon.endpoint, role="admin", identity="admin", timeout_s=0.5, failover_s=60)
    rng = random.Random(5)
    kills = paused = 0
    try:
        wait_until(lambda: admin.stats()["pools"].get("chaos", {}).get("allocations", 0) > 10, 30, "the clients")
        for kills in range(1, 9):
            time.sleep(rng.uniform(0.1, 0.4))
            for c in clients:
                assert c.poll() is None, f"a chaos client failed: {c.stdout.read()}"
            if kills % 2:  # Redis stalls: the async manager keeps acknowledging what it cannot write
                os.kill(redis_proc.pid, signal.SIGSTOP)
                time.sleep(0.2)
                paused += 1
            daemon.kill()
            os.kill(redis_proc.pid, signal.SIGCONT)
            daemon.start()
            for _ in range(3):  # the admin client may be told too
                try:
                    assert admin.call("check")["pools"] <= 1
                    break
                except ManagerRestarted:
                    pass
        outs = finish_chaos_clients(clients, stop)
    finally:
        stop.touch()
        os.kill(redis_proc.pid, signal.SIGCONT)
    assert all(o["event"] == "done" and o["steps"] > 20 for o in outs), outs
    assert all(o["told"] >= 1 for o in outs), outs  # the paused kills lost acks: everyone was told
    admin.call("check")
    admin.close()
    print(f"{kills} async kills ({paused} with Redis stalled): told {[o['told'] for o in outs]}, "
          f"steps {[o['steps'] for o in outs]}")
