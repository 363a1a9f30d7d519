"""The daemon's ROUTER socket: binding it with its options, sending replies, closing it.

An ipc endpoint's directory is created private (the default runtime directory must be the
manager's alone: shared/bind.py); libzmq leaves the socket file behind, so closing unlinks it.
``ROUTER_MANDATORY`` makes a reply that cannot be queued raise instead of vanishing: a client
that does not read (EAGAIN) or is gone (EHOSTUNREACH) loses its reply, counted as dropped, and
the loop never blocks on a send. A peer sending more than twice ``max_message_bytes`` is cut
off by libzmq (``MAXMSGSIZE``). Framing: shared/protocol.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import zmq

from kvpool.manager.stats import ServerStats
from kvpool.shared.bind import ensure_private_dir, runtime_dir


class RouterSocket:
    """``sock`` is None until ``bind`` and after ``close``."""

    def __init__(self, stats: ServerStats, *, endpoint: str, ipc_path: str | None, send_hwm: int,
                 max_message_bytes: int) -> None:
        self.stats, self.endpoint, self.ipc_path = stats, endpoint, ipc_path
        self.send_hwm, self.max_message_bytes = send_hwm, max_message_bytes
        self.sock: zmq.Socket | None = None

    def bind(self, ctx: zmq.Context, secure: Callable[[zmq.Context, zmq.Socket], None]) -> zmq.Socket:
        """A bound ROUTER in ``ctx``; ``secure`` configures it (CURVE) before it binds."""
        if self.ipc_path:
            directory = os.path.dirname(self.ipc_path) or "."
            if os.path.abspath(directory) == os.path.abspath(runtime_dir()):  # the default: must be ours alone
                ensure_private_dir(directory)
            else:
                os.makedirs(directory, mode=0o700, exist_ok=True)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be queued raises: we count it
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)  # beyond this the peer is cut off
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            secure(ctx, sock)  # CURVE, before bind
            sock.bind(self.endpoint)
        except (zmq.ZMQError, ValueError):
            sock.close(linger=0)  # an open socket would block the context's term()
            raise
        self.sock = sock
        return sock

    def send(self, replies: list[list[bytes]]) -> None:
        sock = self.sock
        for frames in replies:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)  # type: ignore[union-attr]
                self.stats.replies += 1
            except zmq.ZMQError:  # EAGAIN (client not reading) or EHOSTUNREACH (client gone)
                self.stats.replies_dropped += 1

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            if self.ipc_path and os.path.exists(self.ipc_path):
                os.unlink(self.ipc_path)  # libzmq leaves the socket file behind
