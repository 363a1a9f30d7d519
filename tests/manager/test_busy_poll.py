"""The manager loop's adaptive busy-poll: windows open after busy iterations only, stop after
empty ones, resume when messages come close together again; and the loop answers through it."""

from __future__ import annotations

import time

import zmq

from kvpool.manager.busy_poll import MAX_MISSES, BusyPoll
from kvpool.shared.protocol import encode_request, unpack


def after(n: int):
    """A ``ready`` that says yes on its n-th call."""
    calls = [0]

    def ready() -> bool:
        calls[0] += 1
        return calls[0] >= n

    return ready


def never() -> bool:
    return False


def test_no_window_before_a_busy_iteration_and_none_when_off():
    bp = BusyPoll(0.01)
    assert not bp.wait(after(1))  # nothing handled yet: the loop blocks as before
    off = BusyPoll(0.0)
    off.busy(time.perf_counter(), time.perf_counter())
    assert not off.wait(after(1)) and not off.spinning and off.hits == off.misses == 0


def test_a_message_within_the_window_is_caught_spinning():
    bp = BusyPoll(30.0)  # long: open when polled on however loaded a machine
    now = time.perf_counter()
    bp.busy(now, now)
    assert bp.wait(after(3)) and bp.hits == 1 and bp.misses == 0
    assert not bp.wait(after(1))  # one window per busy iteration


def test_empty_windows_suspend_spinning_until_messages_come_close_again():
    bp = BusyPoll(0.001)
    for _ in range(MAX_MISSES):
        now = time.perf_counter()
        bp.busy(now - 0.5, now)  # each message came long after the previous iteration
        assert not bp.wait(never)
    assert bp.misses == MAX_MISSES and not bp.spinning
    # from here on the iterations end a minute ahead of the clock, so the window opened below is
    # still open when polled however long a loaded machine keeps this thread off a CPU
    ahead = time.perf_counter() + 60.0
    bp.busy(ahead, ahead)
    assert not bp.wait(after(1))  # suspended: no window, the loop sleeps in poll
    later = ahead + 0.0005  # this message came within a window of the last iteration's end
    bp.busy(later, later + 0.0001)
    assert bp.spinning and bp.wait(after(1)) and bp.hits == 1


def test_the_server_answers_through_the_busy_poll(live_server):
    """Back-to-back requests on a real socket: every one answered, through a loop that spins.
    How many windows open depends on the machine: empty ones suspend spinning and a contended
    CPU backs it off (both rules are tested above on a simulated clock), so all this asserts of
    the count is that the first busy iteration opened a window and the next wait used it."""
    live = live_server(busy_poll_us=50_000)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(live.endpoint)
    try:
        for i in range(1, 21):
            sock.send(encode_request(i, "heartbeat", None, {}))
            assert sock.poll(10_000)
            assert unpack(sock.recv())["id"] == i
        poll = live.server.stats.snapshot()["busy_poll"]
        assert poll["window_us"] == 50_000 and poll["hits"] + poll["misses"] >= 1, poll
    finally:
        sock.close(linger=0)
        ctx.term()


def test_contended_cpus_stop_spinning_for_a_growing_while(monkeypatch):
    """Waiting for a CPU more than MAX_CPU_WAIT of the time while spinning: no windows for
    BACKOFF_S, then twice that after the next contended check; an uncontended check resets it."""
    from kvpool.manager import busy_poll

    waited = [0.0]
    monkeypatch.setattr(busy_poll, "cpu_wait_s", lambda: waited[0])
    bp = BusyPoll(0.001)
    t = time.perf_counter() + 600.0  # simulated time runs ahead of the clock: every window is still open when polled

    def windows(n: int, wait_share: float) -> None:
        nonlocal t
        for _ in range(n):
            t += 0.01
            waited[0] += 0.01 * wait_share
            bp.busy(t, t)
            bp.wait(after(1))

    windows(busy_poll.CHECK_EVERY, 0.5)
    assert bp.backoffs == 1 and bp.hits == busy_poll.CHECK_EVERY - 1
    bp.busy(t + 1.0, t + 1.0)  # within the back-off: no window
    assert not bp.wait(after(1))
    t += busy_poll.BACKOFF_S + 1.0
    windows(busy_poll.CHECK_EVERY, 0.5)
    assert bp.backoffs == 2
    bp.busy(t + busy_poll.BACKOFF_S + 0.5, t + busy_poll.BACKOFF_S + 0.5)  # the second back-off is twice as long
    assert not bp.wait(after(1))
    t += 2 * busy_poll.BACKOFF_S + 1.0
    windows(busy_poll.CHECK_EVERY, 0.0)  # quiet again: spinning stays on
    assert bp.backoffs == 2
    bp.busy(t + 0.01, t + 0.01)
    assert bp.wait(after(1))
