import os
import socket

from kvpool.shared.notify import Notifier


def _listen(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    return s


def test_ready_status_and_watchdog_datagrams(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = _listen(path)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.enabled and n.watchdog_interval == 1.0
    assert n.ready("serving 2 pools")
    assert sock.recv(1024) == b"READY=1\nSTATUS=serving 2 pools"
    assert n.tick(now=100.0)
    assert sock.recv(1024) == b"WATCHDOG=1"
    assert not n.tick(now=100.5), "half the interval has not passed"
    assert n.tick(now=101.0)
    assert sock.recv(1024) == b"WATCHDOG=1"
    assert n.stopping()
    assert sock.recv(1024) == b"STOPPING=1"
    sock.close()


def test_abstract_namespace_socket():
    name = f"kvpool-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
    assert s.recv(64) == b"READY=1"
    s.close()


def test_noop_outside_systemd_and_watchdog_for_other_pid():
    n = Notifier({})
    assert not n.enabled and not n.ready() and not n.tick()
    other = Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None
    assert other.ready() is False, "a dead socket is reported, not raised"


def test_a_receiver_that_stops_reading_never_blocks_the_sender(tmp_path):
    """The manager sends WATCHDOG=1 from its loop: a full notify socket (systemd stalled, or a
    test that stopped reading) must cost a dropped datagram, never a blocked loop."""
    import time

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "n.sock"))
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")})
    t0 = time.monotonic()
    sent = [n.status(f"tick {i}") for i in range(200)]  # far past the receive queue (max_dgram_qlen)
    assert time.monotonic() - t0 < 2.0
    assert sent[0] and not all(sent)  # the first ones arrive, the rest are dropped
    assert sock.recv(100) == b"STATUS=tick 0"
    sock.close()
