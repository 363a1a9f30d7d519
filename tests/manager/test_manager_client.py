"""ManagerClient against a live server thread: registration, steps, restarts, expiry, timeouts."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.manager import SPEC, LiveServer, kv_bytes

from kvpool.client.manager import (
    ManagerClient,
    ManagerError,
    ManagerRestarted,
    ManagerUnavailable,
    SessionExpired,
    StaleEpoch,
)


def reg(c: ManagerClient, rank=0, count=1, inc="i", blocks=64, **kw) -> dict:
    return c.register("p", shard_rank=rank, shard_count=count, incarnation=inc, spec=SPEC,
                      available_kv_bytes=kv_bytes(blocks), **kw)


def test_register_blocks_until_every_shard_has_registered(live_server):
    live = live_server()
    out: dict[int, dict] = {}
    c0, c1 = ManagerClient(live.endpoint), ManagerClient(live.endpoint)
    t = threading.Thread(target=lambda: out.setdefault(0, reg(c0, 0, 2, "a", 100)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # shard 0 waits for shard 1
    out[1] = reg(c1, 1, 2, "b", 60)
    t.join(20)
    assert out[0]["num_blocks"] == out[1]["num_blocks"] == 60
    assert out[0]["epoch"] == out[1]["epoch"] == 1 and out[0]["block_size"] == SPEC["block_size"]
    with pytest.raises(ManagerError) as ei:
        c0.register("q", shard_rank=0, shard_count=2, incarnation="a", spec=SPEC,
                    available_kv_bytes=kv_bytes(8), wait_s=0.2)
    assert ei.value.code == "register_timeout" and "1 of 2" in ei.value.message
    c0.close()
    c1.close()


def test_a_step_is_one_round_trip_and_a_stale_epoch_raises(live_server):
    live = live_server()
    c = ManagerClient(live.endpoint)
    epoch = reg(c)["epoch"]
    before = live.server.stats.messages
    ops = [{"op": "alloc", "req": i, "hashes": [], "prompt_len": 3, "max_new": 3} for i in range(50)]
    results = c.step("p", epoch, ops)
    assert live.server.stats.messages == before + 1
    assert [r["blocks"] for r in results[:2]] == [[1], [2]] and all(r["ok"] for r in results)
    reg(c, inc="restarted")
    with pytest.raises(StaleEpoch) as ei:
        c.step("p", epoch, [])
    assert ei.value.epoch == 2 and ei.value.code == "stale_epoch"
    assert c.lookup("p", []) == 0 and c.locate([]) == {"p": 0}
    c.close()


@pytest.mark.parametrize("receiver_thread", [False, True])
def test_a_step_sent_with_begin_is_answered_while_the_caller_works(live_server, receiver_thread):
    """begin_step returns before the reply; the manager runs the step meanwhile; end_step
    collects it (the worker's overlap of the round trip with its forward pass)."""
    live = live_server()
    c = ManagerClient(live.endpoint, receiver_thread=receiver_thread)
    epoch = reg(c)["epoch"]
    before = live.server.stats.messages
    pending = c.begin_step("p", epoch, [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 3, "max_new": 3}])
    deadline = time.monotonic() + 10
    while live.server.stats.messages == before and time.monotonic() < deadline:
        time.sleep(0.001)  # "computing": the manager handles the step without our waiting on it
    assert live.server.stats.messages == before + 1
    if receiver_thread:  # the thread read and decoded the reply while we "computed"
        assert pending.job is not None and pending.job.done.wait(10)
        assert pending.job.reply["id"] == pending.msg_id
    assert c.end_step(pending) == [{"ok": True, "cached": 0, "blocks": [1]}]
    assert c.step("p", epoch, [{"op": "free", "req": 1}]) == [{"ok": True}]  # the socket is free again
    reg(c, inc="restarted")
    with pytest.raises(StaleEpoch):
        c.end_step(c.begin_step("p", epoch, []))
    c.close()


@pytest.mark.parametrize("receiver_thread", [False, True])
def test_an_unanswered_begin_step_raises_unavailable_at_end(sock_dir, receiver_thread):
    live = LiveServer(f"ipc://{sock_dir}/gone.sock")
    c = ManagerClient(live.endpoint, timeout_s=10, receiver_thread=receiver_thread)
    epoch = reg(c)["epoch"]
    live.stop()
    c.timeout_s = 0.3
    pending = c.begin_step("p", epoch, [])
    with pytest.raises(ManagerUnavailable, match="no reply to 'step'"):
        c.end_step(pending)
    c.close()


def test_a_call_after_an_uncollected_begin_step_waits_for_the_receiver_thread(live_server):
    """A step whose end_step never comes (the caller gave up on it): the next call waits until
    the thread is done with the socket, then runs; the late reply answers nothing else."""
    live = live_server()
    c = ManagerClient(live.endpoint, receiver_thread=True)
    epoch = reg(c)["epoch"]
    abandoned = c.begin_step("p", epoch, [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 3, "max_new": 3}])
    assert c.step("p", epoch, [{"op": "alloc", "req": 2, "hashes": [], "prompt_len": 3, "max_new": 3}]) == [
        {"ok": True, "cached": 0, "blocks": [2]}]
    assert abandoned.job is not None and abandoned.job.done.is_set() and abandoned.job.reply["id"] == abandoned.msg_id
    c.close()


def test_a_manager_restart_is_reported_once_then_the_client_rejoins(sock_dir):
    endpoint = f"ipc://{sock_dir}/r.sock"
    first = LiveServer(endpoint)
    seen = []
    c = ManagerClient(endpoint, timeout_s=10)
    c.on_restart = lambda old, new: seen.append((old, new))
    try:
        reg(c)
        old = c.incarnation
        first.stop()
        second = LiveServer(endpoint)
        try:
            with pytest.raises(ManagerRestarted) as ei:
                c.heartbeat()
            assert (ei.value.old, ei.value.new) == (old, second.server.incarnation) and seen == [(old, ei.value.new)]
            assert reg(c)["epoch"] == 1 and c.incarnation == second.server.incarnation  # hello again, implicitly
            assert c.restarts == 1
        finally:
            second.stop()
    finally:
        first.server.request_stop()
        c.close()


def test_an_expired_session_raises_session_expired(live_server):
    live = live_server(session_timeout_s=0.3)
    c = ManagerClient(live.endpoint)
    epoch = reg(c)["epoch"]
    c.step("p", epoch, [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 3, "max_new": 3}])
    time.sleep(1.0)
    with pytest.raises(SessionExpired) as ei:
        c.step("p", epoch, [])
    assert ei.value.code == "session_expired" and isinstance(ei.value, ManagerRestarted)
    assert live.server.stats.expired_requests_freed == 1
    c.heartbeat()  # a new session
    c.close()


def test_maybe_heartbeat_only_when_idle(live_server):
    live = live_server(session_timeout_s=3.0)
    c = ManagerClient(live.endpoint)
    c.hello()
    assert c.heartbeat_interval_s == pytest.approx(1.0)
    assert not c.maybe_heartbeat()
    c._last_call -= 2.0
    assert c.maybe_heartbeat()
    c.close()


def test_unreachable_manager_times_out_and_failover_uses_the_next_endpoint(live_server, sock_dir):
    dead = f"ipc://{sock_dir}/nobody.sock"
    c = ManagerClient(dead, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ManagerUnavailable, match="nobody.sock"):
        c.stats()
    assert 0.25 < time.monotonic() - t0 < 5
    c.close()
    live = live_server()
    c = ManagerClient([dead, live.endpoint], timeout_s=0.3)
    assert c.hello()["incarnation"] == live.server.incarnation and c.endpoint == live.endpoint
    c.close()


def test_context_manager_deregisters(live_server):
    live = live_server()
    with ManagerClient(live.endpoint) as c:
        epoch = reg(c)["epoch"]
        c.step("p", epoch, [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 3, "max_new": 3}])
    assert live.server.registry.sessions == {} and live.server.registry.total_requests() == 0


def test_a_too_large_request_is_answered_with_a_nil_id_and_the_client_takes_it(live_server):
    live = live_server()
    c = ManagerClient(live.endpoint, timeout_s=5)
    reg(c)
    hashes = [bytes(32)] * ((live.server.cfg.max_message_bytes // 34) + 1000)  # over the limit, under 2x
    t0 = time.monotonic()
    with pytest.raises(ManagerError) as ei:
        c.lookup("p", hashes)
    assert ei.value.code == "too_large" and time.monotonic() - t0 < 4.5, "an error, not a timeout"
    assert c.lookup("p", []) == 0  # the same session carries on
    c.close()


def test_a_second_worker_waits_for_the_shards_session_then_takes_over(live_server):
    live = live_server(session_timeout_s=1.0)
    first, second = ManagerClient(live.endpoint), ManagerClient(live.endpoint)
    assert reg(first, inc="a")["epoch"] == 1
    with pytest.raises(ManagerError) as ei:
        reg(second, inc="b", wait_s=0.3)  # the shard is held by a live session
    assert ei.value.code == "not_owner"
    first.close()  # the first worker stops talking: its session expires, the shard is free
    assert reg(second, inc="b", wait_s=10)["epoch"] == 2
    second.close()


def test_a_reply_below_the_commit_sequence_seen_is_a_lost_manager(sock_dir):
    """Defence in depth for a manager that does not check the ``seq`` clients send (PROTOCOL.md
    section 3): the client itself treats a lower ``seq`` under the same state id as a new state.
    The peer is a ROUTER socket answering as such a manager would."""
    import zmq

    from kvpool.shared.protocol import ok_reply, unpack

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{sock_dir}/fake.sock")
    seqs = iter([10, 12, 11, 11])
    seen: list[dict] = []

    def serve() -> None:
        for _ in range(4):
            ident, payload = router.recv_multipart()
            msg = unpack(payload)
            seen.append(msg)
            body = {"sid": "x", "session": 1, "incarnation": "i", "state_id": "s", "durable": True} \
                if msg["op"] == "hello" else {}
            router.send_multipart([ident, ok_reply(msg["id"], "i", body, "s", next(seqs))])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = ManagerClient(f"ipc://{sock_dir}/fake.sock", timeout_s=5.0)
    restarts: list[tuple] = []
    c.on_restart = lambda old, new: restarts.append((old, new))
    try:
        c.hello()
        c.heartbeat()
        assert c.commit_seq == 12 and seen[1]["seq"] == 10  # each request says what it saw
        with pytest.raises(ManagerRestarted, match="went back from commit 12 to 11"):
            c.heartbeat()
        assert c.sid is None and restarts == [("s", "s")] and c.restarts == 1
        c.hello()  # joins again: the lower sequence is now the one it knows
        assert c.commit_seq == 11
        t.join(5)
    finally:
        c.close()
        router.close(linger=0)
