"""shared/procs.py's ``free_port``: a port no other process is handed meanwhile."""

from __future__ import annotations

import socket

from kvpool.shared import procs


def test_a_free_port_lies_below_the_kernels_ephemeral_range_and_binds() -> None:
    low = procs._ephemeral_low()
    ports = {procs.free_port() for _ in range(20)}
    assert all(procs.LOWEST_PORT <= p < low for p in ports) and len(ports) > 1
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out(monkeypatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", procs.free_port()))
    port = held.getsockname()[1]
    real, picks = procs.random.SystemRandom.randrange, [port, port]  # the held port twice, then random
    monkeypatch.setattr(procs.random.SystemRandom, "randrange",
                        lambda self, a, b: picks.pop() if picks else real(self, a, b))
    try:
        got = procs.free_port()
        assert got != port and not picks  # the held port was tried twice, then passed over
        with socket.socket() as s:
            s.bind(("127.0.0.1", got))
    finally:
        held.close()


def test_without_room_below_the_range_the_kernel_picks(monkeypatch) -> None:
    monkeypatch.setattr(procs, "_ephemeral_low", lambda: procs.LOWEST_PORT + 10)
    port = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
