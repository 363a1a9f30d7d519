"""The generate client, sync transport (worker/server.py serves it; PROTOCOL.md section 12):
`kvpool generate`, the demo, tests. One core with the asyncio ``WorkerLink``
(client/generate_core.py); the messages are shared/generate.py's records.

A client learns within a few seconds why a request cannot be served, instead of waiting out
its timeout (``WorkerUnavailable.cause``):

    no_socket            the ipc socket file does not exist: no worker serves that endpoint
    not_listening        nothing accepts connections there (a stale file, a closed port)
    gone                 the worker's connection closed while the request was open (it died)
    silent               no message, not even a heartbeat, for ``liveness_s``
    draining             the manager refuses new allocations (an operator ran `kvpool drain`)
    manager_unreachable  the worker cannot reach its manager for ``manager_grace_s``
    timeout              the request did not finish within ``timeout_s``

A request that is given up (any of these, Ctrl-C, an exception in the caller) is aborted on the
worker, so it stops generating for nobody and frees its blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.client.generate_core import MANAGER_GRACE_S, GenerateCore, Stream, WorkerUnavailable
from kvpool.shared.curve import ClientKeys
from kvpool.shared.generate import Pong, StatsReply, TokenMessage, pack, parse_reply

__all__ = ["GenerateClient", "WorkerUnavailable", "ping_once"]
MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class GenerateClient:
    """One DEALER socket to one worker; many requests may be in flight at once."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None, curve: ClientKeys | None = None, *,
                 connect_timeout_s: float = 2.0, liveness_s: float = 30.0,
                 manager_grace_s: float = MANAGER_GRACE_S) -> None:
        """``curve``: the worker's public key and this client's keys, when the worker runs CURVE."""
        self.endpoint = endpoint
        self.connect_timeout_s, self.liveness_s, self.manager_grace_s = connect_timeout_s, liveness_s, manager_grace_s
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self._monitor = self.sock.get_monitor_socket(MONITORED)
        self.connected = False
        self.sock.connect(endpoint)
        self._core = GenerateCore()

    # -- sending -----------------------------------------------------------------------------

    def send(self, op: str, **body: object) -> str:
        """Any message, as given (tests' probes of a worker): ``generate`` and the controls go
        through ``submit``, ``stats``, ``ping`` and ``abort``."""
        rid = str(body.pop("id", None) or self._core.next_id(op))
        self._put(pack({"op": op, "id": rid, **body}))
        return rid

    def _put(self, payload: bytes) -> None:
        try:  # a socket whose connection was refused (CURVE) has nowhere to queue: never block
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            raise WorkerUnavailable(f"cannot send to the worker at {self.endpoint}: no connection (refused by "
                                    "its CURVE keys, or its queue is full); open a new client",
                                    "not_listening") from None

    def submit(self, prompt: list[int], cache_salt: str | None = None, **params: object) -> str:
        """Sends a generate request (``params`` unchecked: the worker's refusal says what is wrong)."""
        rid, payload = self._core.generate(list(prompt), params, cache_salt)
        self._put(payload)
        return rid

    def abort(self, rid: str) -> None:
        """Tells the worker to drop request ``rid`` (best effort: the worker may be gone)."""
        try:
            self.sock.send(self._core.control("abort", rid)[1], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- connection state --------------------------------------------------------------------

    def _poll_monitor(self) -> None:
        """Applies the connection events seen so far; raises when the worker went away."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                raise WorkerUnavailable(f"the worker at {self.endpoint} went away (its connection closed): "
                                        "it stopped or died", "gone")

    def check_reachable(self) -> None:
        """Raises WorkerUnavailable unless a worker accepts connections at the endpoint."""
        path = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        if path is not None and not os.path.exists(path):
            raise WorkerUnavailable(f"no worker serves {self.endpoint}: the socket file does not exist", "no_socket")
        deadline = time.monotonic() + self.connect_timeout_s
        while not self.connected:
            left = deadline - time.monotonic()
            if left <= 0:
                what = "a stale socket file left by a worker that is gone" if path else "nothing listens there"
                raise WorkerUnavailable(f"no worker accepts connections at {self.endpoint} ({what})",
                                        "not_listening")
            if self._monitor.poll(left * 1000):
                self._poll_monitor()

    # -- receiving ---------------------------------------------------------------------------

    def recv(self, timeout_s: float) -> dict | None:
        if not self.sock.poll(timeout_s * 1000, zmq.POLLIN):
            return None
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def _next(self, deadline: float) -> dict | None:
        """The next message before ``deadline``, watching the connection meanwhile."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if self._monitor in ready:
                self._poll_monitor()
            if self.sock in ready:
                return msgpack.unpackb(self.sock.recv(), raw=False)
        return None

    def call(self, op: str, timeout_s: float = 5.0) -> dict:
        """A request with one reply (stats, ping), the reply as sent."""
        rid, payload = self._core.control(op)
        self._put(payload)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg is not None and msg.get("id") == rid:
                return msg
        raise WorkerUnavailable(f"no reply to {op!r} from the worker at {self.endpoint} in {timeout_s}s")

    def stats(self, timeout_s: float = 5.0) -> dict:
        return StatsReply.from_wire(self.call("stats", timeout_s)).stats

    def ping(self, timeout_s: float = 5.0) -> str:
        """The pool the worker serves."""
        return Pong.from_wire(self.call("ping", timeout_s)).pool

    def stream(self, prompt: list[int], timeout_s: float = 60.0, **params: object) -> Iterator[TokenMessage]:
        """Token messages of one request until all its samples finished (heartbeats are not
        yielded). Raises WorkerUnavailable (see the module docstring) or ValueError (refused)."""
        self.check_reachable()
        rid = self.submit(prompt, **params)
        stream = Stream(rid, int(params.get("n", 1)), self.manager_grace_s)
        deadline = time.monotonic() + timeout_s
        try:
            while not stream.done:
                now = time.monotonic()
                msg = self._next(min(deadline, now + self.liveness_s))
                if msg is None:
                    if time.monotonic() >= deadline:
                        raise WorkerUnavailable(f"the request did not finish within {timeout_s}s", "timeout")
                    raise WorkerUnavailable(f"the worker at {self.endpoint} sent nothing, not even a heartbeat, "
                                            f"for {self.liveness_s}s: it is stuck or paused", "silent")
                token = stream.feed(parse_reply(msg))
                if token is not None:
                    yield token
        finally:
            if not stream.done:
                self.abort(rid)

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.sock.close(linger=200)  # a final abort still goes out
        self._monitor.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


def ping_once(endpoint: str, timeout_s: float = 1.0) -> tuple[bool, str | None]:
    """(anything answered, the pool a pong named) for one ``ping`` with id ``probe``: no
    monitor, no retry (worker/endpoint.py asks whether a live worker holds a path)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(GenerateCore().control("ping", "probe")[1])
        if not sock.poll(timeout_s * 1000, zmq.POLLIN):
            return False, None
        reply = parse_reply(msgpack.unpackb(sock.recv(), raw=False))
        return True, reply.pool if isinstance(reply, Pong) and isinstance(reply.pool, str) else None
    finally:
        sock.close(linger=0)
