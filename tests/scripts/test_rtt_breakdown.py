"""scripts/rtt_breakdown.py: the clients' steps joined to the daemon's message rows add up to each
round trip, part by part, and the tail line names what the slowest steps add."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
rb = importlib.import_module("rtt_breakdown")


def rows(*rs: tuple) -> dict[str, list]:
    """Message rows in the stats op's column layout (manager/message_times.py FIELDS)."""
    names = ("session", "id", "op", "ready", "start", "handled", "sent", "cpu")
    return {n: [r[i] for r in rs] for i, n in enumerate(names)}


def client(*steps: tuple) -> dict[str, np.ndarray]:
    return {f: np.array([s[i] for s in steps], dtype=float) for i, f in enumerate(rb.CLIENT_FIELDS)}


def test_busy_between_counts_only_the_loop_s_iterations():
    starts, ends = rb.busy_clock(np.array([1.0, 1.0, 3.0]), np.array([1.5, 2.0, 4.0]))
    assert starts.tolist() == [1.0, 3.0] and ends.tolist() == [2.0, 4.0]  # an iteration ends at its last reply
    got = rb.busy_between(starts, ends, np.array([0.0, 1.5, 2.5, 0.0]), np.array([0.5, 3.5, 2.9, 9.0]))
    assert got.tolist() == [0.0, 1.0, 0.0, 2.0]
    # an amount spread over its interval: half of [1, 2]'s 0.5 and a quarter of [3, 4]'s 2.0
    spread = rb.spread_between(starts, ends, np.array([0.5, 2.0]), np.array([1.5]), np.array([3.25]))
    assert spread.tolist() == [0.75]


def test_join_splits_each_round_trip_into_parts_that_add_up():
    daemon = rows(
        # iteration A (ready 10.0): client 1's first step, then client 2's behind it
        (1, 1, "step", 10.0, 10.0, 10.004, 10.004, 0.003),
        (2, 1, "step", 10.0, 10.004, 10.006, 10.006, 0.002),
        # iteration B: client 1's second step, sent while A was still busy
        (1, 2, "step", 10.007, 10.007, 10.009, 10.0095, 0.002),
        # iteration C: client 3, alone
        (3, 1, "step", 10.0126, 10.0126, 10.0126, 10.0126, 0.0),
    )
    # (id, begin, sent, recv, send_wait, recv_wait, send_gc, recv_gc, io_wait); client 1's third
    # step is no longer in the daemon's ring
    steps = {1: client((1, 9.9993, 9.9995, 10.0045, 0.0, 0.0, 0.0, 0.0, 0.0),
                       (2, 10.004, 10.005, 10.010, 0.0005, 0.0, 0.0, 0.0002, 0.0003),
                       (3, 10.02, 10.021, 10.03, 0.0, 0.0, 0.0, 0.0, 0.0)),
             2: client((1, 9.999, 9.999, 10.0065, 0.0, 0.0001, 0.0, 0.0, 0.0)),
             # preempted for 3 ms after its hand-over, mostly while the daemon worked: 0.5 ms counts
             3: client((1, 10.0065, 10.0066, 10.0131, 0.0, 0.003, 0.0, 0.0, 0.0))}
    p = rb.join(steps, daemon)
    assert len(p["rtt"]) == 4
    expect = {  # per part: client 1 step 1, client 1 step 2, client 2 step 1, client 3 step 1
        "client_send": [0.0002, 0.0005, 0.0, 0.0001], "socket": [0.0, 0.001, 0.0, 0.0025],
        "to_loop": [0.0005, 0.001, 0.001, 0.0035], "behind": [0.0, 0.0, 0.004, 0.0],
        "daemon_cpu": [0.003, 0.002, 0.002, 0.0], "daemon_wait": [0.001, 0.0, 0.0, 0.0],
        "held": [0.0, 0.0005, 0.0, 0.0], "to_client": [0.0005, 0.0003, 0.0004, 0.0],
        "client_gc": [0.0, 0.0002, 0.0, 0.0], "client_wait": [0.0, 0.0005, 0.0001, 0.0005],
    }
    # while client 2's step queued, the loop handled client 1's first step (3 ms CPU, 1 ms waiting
    # for a core); client 1's second step queued through the last millisecond of client 2's
    expect |= {"queue_cpu": [0.0, 0.001, 0.003, 0.002], "queue_wait": [0.0, 0.0, 0.001, 0.0],
               "client_io_wait": [0.0, 0.0003, 0.0, 0.0]}
    for part, values in expect.items():
        assert p[part] == pytest.approx(values, abs=1e-9), part
    assert p["rtt"] == pytest.approx([0.0052, 0.006, 0.0075, 0.0066], abs=1e-12)
    assert sum(p[n] for n in rb.PARTS) == pytest.approx(p["rtt"], abs=1e-12)
    with pytest.raises(ValueError, match="no step joined"):
        rb.join({4: steps[1]}, daemon)


def test_step_times_records_one_row_per_step_with_its_id_and_clock_order():
    class Pending:
        def __init__(self, msg_id: int) -> None:
            self.msg_id = msg_id

    ids = iter([41, 42])
    timed = rb.StepTimes(lambda ops: Pending(next(ids)), lambda pending: [{"ok": True, "n": len(pending.__dict__)}])
    try:
        assert timed.step([{"op": "free", "req": 1}]) == [{"ok": True, "n": 1}]
        timed.step([])
    finally:
        timed.close()
    cols = timed.columns()
    assert cols["id"].tolist() == [41, 42] and list(cols) == list(rb.CLIENT_FIELDS)
    assert (cols["begin"] <= cols["sent"]).all() and (cols["sent"] <= cols["recv"]).all()
    assert (cols["send_wait"] >= 0).all() and (cols["io_wait"] >= 0).all()


def test_attribute_puts_the_tail_where_the_slow_steps_spent_it():
    n = 200
    parts = {name: np.zeros(n) for name in rb.PARTS}
    parts["daemon_cpu"][:] = 0.001
    parts["socket"][:] = 0.001
    parts["socket"][-2:] = 0.006  # two steps waited 5 ms longer in the socket
    parts["rtt"] = sum(parts[name] for name in rb.PARTS)
    parts["queue_cpu"], parts["queue_wait"] = parts["socket"].copy(), np.zeros(n)  # the daemon worked on others
    parts["client_io_wait"] = np.zeros(n)
    a = rb.attribute(parts)
    assert a["tail_steps"] == 2 and a["steps"] == n
    assert a["socket_tail_us"] - a["socket_mid_us"] == pytest.approx(5000)
    assert a["daemon_cpu_tail_us"] == pytest.approx(1000) and a["daemon_cpu_mid_us"] == pytest.approx(1000)
    assert a["queue_share"] == pytest.approx((198 * 0.001 + 2 * 0.006) / (198 * 0.002 + 2 * 0.007))
    line = rb.tail_line(a)
    assert "queueing behind other clients' messages +5,000" in line and "the daemon handling them +0 " in line
    assert "tail in short: queueing behind other clients' work +5,000, the daemon's own work on the message +0," in line


def test_a_client_clocked_after_the_loop_read_its_message_queued_for_no_time():
    """Preempted right after its send, the client reads its clock 3 ms later, when the loop
    has read and answered the message already: nothing queued (no negative socket time), and
    of its 2.5 ms stall only the 1 ms before the hand-over counts as its own wait."""
    daemon = rows((4, 1, "step", 20.0, 20.0, 20.001, 20.001, 0.001))
    steps = {4: client((1, 19.999, 20.003, 20.004, 0.0025, 0.0, 0.0, 0.0, 0.0))}
    p = rb.join(steps, daemon)
    expect = {"client_send": 0.0, "socket": 0.0, "to_loop": 0.0, "behind": 0.0, "daemon_cpu": 0.001,
              "daemon_wait": 0.0, "held": 0.0, "to_client": 0.003, "client_gc": 0.0, "client_wait": 0.001,
              "queue_cpu": 0.0, "queue_wait": 0.0}
    for part, value in expect.items():
        assert p[part] == pytest.approx([value], abs=1e-9), part
    assert sum(p[n] for n in rb.PARTS) == pytest.approx(p["rtt"], abs=1e-12) and p["rtt"][0] == pytest.approx(0.005)
    assert rb.attribute(p)["queue_share"] == 0.0


def test_a_message_drained_after_its_iteration_began_splits_without_nan():
    """The loop stamps ``ready`` before it drains its socket; a step sent during the drain (a
    drain preempted under load) carries a ``ready`` before its own begin. It once made the send
    side 0 / 0 (NaN), and bench_manager died in tail_line: it was ready no earlier than its begin."""
    daemon = rows((5, 1, "step", 30.0, 30.002, 30.003, 30.003, 0.001))
    steps = {5: client((1, 30.001, 30.0011, 30.004, 0.0, 0.0, 0.0, 0.0, 0.0))}
    p = rb.join(steps, daemon)
    assert all(np.isfinite(p[n]).all() for n in p), p
    expect = {"client_send": 0.0, "socket": 0.0, "to_loop": 0.0, "behind": 0.001, "daemon_cpu": 0.001,
              "to_client": 0.001, "client_gc": 0.0, "client_wait": 0.0}
    for part, value in expect.items():
        assert p[part] == pytest.approx([value], abs=1e-9), part
    assert sum(p[n] for n in rb.PARTS) == pytest.approx(p["rtt"], abs=1e-12)
    assert "+0 us" in rb.tail_line(rb.attribute({k: np.repeat(v, 20) for k, v in p.items()}))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10])
def test_a_few_steps_still_have_a_median_to_compare_the_tail_with(n):
    """Under 11 steps, p45..p55 can fall between two round trips: the mean of no steps was NaN."""
    parts = {name: np.zeros(n) for name in (*rb.PARTS, *rb.QUEUE_PARTS, *rb.ASIDE)}
    parts["socket"][:] = np.arange(1, n + 1) * 0.001
    parts["rtt"] = parts["socket"].copy()
    a = rb.attribute(parts)
    assert all(np.isfinite(v) for v in a.values() if isinstance(v, float)), a
    assert a["rtt_tail_us"] == pytest.approx(n * 1000) and a["rtt_mid_us"] <= a["rtt_tail_us"]
    rb.tail_line(a)
    with pytest.raises(ValueError, match="NaN"):
        rb.attribute({**parts, "rtt": np.full(n, np.nan)})
