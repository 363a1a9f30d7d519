"""Per-message timings of the manager loop (manager/message_times.py): the ring's quantiles, the
rows the loop keeps for each message on a real socket, and the stats op that hands them out."""

from __future__ import annotations

import random
import time

import pytest
import zmq
from helpers.manager import call, hello, make_server, ok, register, wait_until

from kvpool.manager.config import ManagerConfig
from kvpool.manager.message_times import FIELDS, MessageTimes
from kvpool.manager.server import Server
from kvpool.manager.stats import ServerStats
from kvpool.manager.store.base import EventSink
from kvpool.shared.protocol import encode_request, unpack


def test_summary_splits_each_message_into_behind_service_cpu_and_held_per_op():
    mt = MessageTimes()
    #             who            ready start handled sent  cpu
    mt.observe((1, 10, "step"), 1.0, 1.0, 1.5, 1.5, 0.4)
    mt.observe((2, 11, "step"), 1.0, 1.5, 1.75, 1.75, 0.25)
    mt.observe((1, 12, "heartbeat"), 2.0, 2.0, 2.125, 2.5, 0.125)
    s = mt.summary()
    assert sorted(s) == ["heartbeat", "step"] and s["step"]["count"] == 2
    # two values: p50 is the larger (index n // 2), as is p99
    assert (s["step"]["behind_p50"], s["step"]["behind_max"]) == (0.5, 0.5)
    assert (s["step"]["service_p50"], s["step"]["service_p99"]) == (0.5, 0.5)
    assert s["step"]["cpu_p50"] == 0.4 and s["step"]["held_max"] == 0.0
    assert (s["heartbeat"]["service_p50"], s["heartbeat"]["held_p50"]) == (0.125, 0.375)


def test_the_ring_keeps_the_latest_messages_and_hands_them_out_by_column():
    mt = MessageTimes(size=2)
    for i in range(3):
        mt.observe((-1, i, ""), float(i), float(i), float(i), float(i), 0.0)
    cols = mt.columns()
    assert tuple(cols) == FIELDS and cols["id"] == [1, 2] and cols["op"] == ["", ""]
    assert list(mt.summary()) == ["invalid"]  # no op: the message never resolved
    with pytest.raises(ValueError, match="at least one message"):
        MessageTimes(size=0)


def bound_server(sock_dir: str, **kw) -> tuple[Server, zmq.Context, zmq.Socket]:
    srv = Server(ManagerConfig(endpoint=f"ipc://{sock_dir}/m.sock"), **kw)
    srv.bind()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(srv.cfg.endpoint)
    return srv, ctx, dealer


def exchange(srv: Server, dealer: zmq.Socket, msgs: list[tuple[int, str, str | None]]) -> list[dict]:
    """Sends every message, then turns the loop until each reply is back."""
    for msg_id, op, sid in msgs:
        dealer.send(encode_request(msg_id, op, sid, {}))
    replies: list[dict] = []

    def turn() -> bool:
        srv.run_once(100)
        while dealer.poll(0):
            replies.append(unpack(dealer.recv()))
        return len(replies) == len(msgs)

    wait_until(turn, what="every reply")
    return replies


def rows(srv: Server) -> list[dict]:
    cols = srv.stats.message_times.columns()
    return [dict(zip(FIELDS, r, strict=True)) for r in zip(*cols.values(), strict=True)]


@pytest.mark.parametrize("events", [False, True], ids=["reply-at-once", "group-commit"])
def test_each_message_gets_a_row_in_loop_order(sock_dir, events):
    class Sink(EventSink):  # a given sink makes the loop hold replies until the iteration's commit
        def publish(self, pool, epoch, evs):
            pass

        def close(self):
            pass

    srv, ctx, dealer = bound_server(sock_dir, publisher=Sink() if events else None)
    try:
        sid = ok(exchange(srv, dealer, [(1, "hello", None)])[0])["sid"]
        num = srv.registry.sessions[sid].num
        replies = exchange(srv, dealer, [(2, "heartbeat", sid), (3, "heartbeat", sid), (4, "nope", sid)])
        assert [r["status"] for r in replies] == ["ok", "ok", "unknown_op"]
        got = rows(srv)
        assert [(r["session"], r["id"], r["op"]) for r in got] == [
            (-1, 1, "hello"), (num, 2, "heartbeat"), (num, 3, "heartbeat"), (-1, -1, "")]
        for r in got:
            assert r["ready"] <= r["start"] <= r["handled"] <= r["sent"] and 0 <= r["cpu"]
            assert events or r["sent"] == r["handled"]  # nothing to wait for: handed to the socket at once
        for a, b in zip(got, got[1:], strict=False):  # one message at a time, in arrival order
            assert a["handled"] <= b["start"]
            if a["ready"] == b["ready"]:  # the same iteration
                assert (a["sent"] == b["sent"]) if events else (a["sent"] <= b["start"])
    finally:
        dealer.close(linger=0)
        ctx.term()
        srv.close()


def test_stats_reports_per_op_quantiles_and_rows_only_to_admin_sessions():
    srv = make_server(admin_key="k" * 8)  # without a key every session is an admin (PROTOCOL.md 5)
    admin, worker = hello(srv, role="admin", admin_key="k" * 8), hello(srv, role="worker")
    srv.stats.message_times.observe((1, 5, "step"), 1.0, 1.25, 1.5, 1.5, 0.125)  # call() skips the loop's timing
    manager = ok(call(srv, "stats", worker))["manager"]
    assert manager["message_recent"]["step"]["service_p50"] == 0.25 and "message_rows" not in manager
    rows_ = ok(call(srv, "stats", admin, message_rows=True))["manager"]["message_rows"]
    assert rows_["id"] == [5] and rows_["cpu"] == [0.125]
    assert call(srv, "stats", worker, message_rows=True)["status"] == "forbidden"
    assert call(srv, "stats", admin, message_rows=1)["status"] == "bad_field"
    ok(register(srv, worker))  # the refusals changed nothing


def test_quantiles_are_those_of_the_sorted_values_per_op_and_per_iteration():
    """The stats op picks quantiles by partition (it runs on the loop): the values are exactly
    the sorted lists' at index n // 2, n * 99 // 100 (n * 9 // 10) and n - 1."""
    rng = random.Random(7)
    mt, stats = MessageTimes(size=3000), ServerStats()
    for i in range(5000):  # more than the ring holds: only the last 3000 count
        t = [rng.random() for _ in range(4)]
        mt.observe((1, i, rng.choice(["step", "heartbeat", ""])), t[0], t[0] + t[1], t[0] + t[1] + t[2],
                   t[0] + t[1] + t[2] + t[3], rng.random() / 3)
        stats.observe_iteration(rng.random(), rng.random(), rng.randint(1, 9))

    def picks(xs: list[float], *fractions: tuple[int, int]) -> list[float]:
        xs, n = sorted(xs), len(xs)
        return [xs[min(n - 1, n * a // b)] for a, b in fractions] + [xs[-1]]

    rows = list(mt.rows)
    s = mt.summary()
    assert sorted(s) == ["heartbeat", "invalid", "step"]
    for op, name in (("step", "step"), ("heartbeat", "heartbeat"), ("", "invalid")):
        mine = [r for r in rows if r[2] == op]
        assert s[name]["count"] == len(mine)
        for span, (a, b) in (("behind", (4, 3)), ("service", (5, 4)), ("held", (6, 5)), ("cpu", (7, None))):
            xs = [r[a] - r[b] if b is not None else r[a] for r in mine]
            assert [s[name][f"{span}_{q}"] for q in ("p50", "p99", "max")] == picks(xs, (1, 2), (99, 100))
    it = stats.recent_summary()
    for key, col in (("", 0), ("cpu_", 1)):
        xs = [r[col] for r in stats.recent]
        assert [it[f"{key}{q}"] for q in ("p50", "p90", "p99", "max")] == picks(xs, (1, 2), (9, 10), (99, 100))


@pytest.mark.parametrize("slice_ms, per_iteration", [(1e-6, 1), (0.0, 40)], ids=["sliced", "unsliced"])
def test_an_iteration_stops_reading_once_its_slice_is_spent(sock_dir, slice_ms, per_iteration):
    """max_batch_ms: the loop leaves what is still queued for the next iteration, so a client
    behind a flood is not held for the whole flood's commit; 0 reads up to max_batch."""
    srv = Server(ManagerConfig(endpoint=f"ipc://{sock_dir}/m.sock", max_batch_ms=slice_ms))
    srv.bind()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(srv.cfg.endpoint)
    try:
        for i in range(40):
            dealer.send(encode_request(i + 1, "hello", None, {}))
        wait_until(lambda: srv.sock.poll(0), what="the first message")
        time.sleep(0.2)  # all 40 queued at the manager
        assert srv.run_once(100) == per_iteration
        handled = per_iteration
        while handled < 40:
            handled += srv.run_once(100)
        replies = [unpack(dealer.recv()) for _ in range(40)]
        assert [r["id"] for r in replies] == list(range(1, 41)) and all(r["status"] == "ok" for r in replies)
    finally:
        dealer.close(linger=0)
        srv.close()
        ctx.term()


def test_max_batch_ms_is_checked():
    for bad in (-1, 10_001, "5", None):
        with pytest.raises(ValueError, match="max_batch_ms"):
            ManagerConfig(endpoint="ipc:///tmp/x.sock", max_batch_ms=bad)
