"""Client of the worker's generate service (worker/server.py): `kvpool generate`, the demo.

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

import itertools
import os
import time
from collections.abc import Iterator

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.shared.curve import ClientKeys

MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class WorkerUnavailable(RuntimeError):
    def __init__(self, message: str, cause: str = "timeout") -> None:
        super().__init__(message)
        self.cause = cause


def pack(obj: dict) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as e:  # e.g. an integer beyond 64 bits
        raise ValueError(f"cannot encode the request: {e}; integers must fit in 64 bits") from None


class GenerateClient:
    """One DEALER socket to one worker; many requests may be in flight at once."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None, curve: ClientKeys | None = None, *,
                 connect_timeout_s: float = 2.0, liveness_s: float = 30.0, manager_grace_s: float = 5.0) -> None:
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
        self._ids = itertools.count()

    # -- sending -----------------------------------------------------------------------------

    def send(self, op: str, **body: object) -> str:
        rid = str(body.pop("id", None) or f"{op}-{next(self._ids)}")
        try:  # a socket whose connection was refused (CURVE) has nowhere to queue: never block
            self.sock.send(pack({"op": op, "id": rid, **body}), zmq.NOBLOCK)
        except zmq.Again:
            raise WorkerUnavailable(f"cannot send to the worker at {self.endpoint}: no connection (refused by "
                                    "its CURVE keys, or its queue is full); open a new client",
                                    "not_listening") from None
        return rid

    def submit(self, prompt: list[int], **params: object) -> str:
        return self.send("generate", prompt=list(prompt), params=params)

    def abort(self, rid: str) -> None:
        """Tells the worker to drop request ``rid`` (best effort: the worker may be gone)."""
        try:
            self.sock.send(pack({"op": "abort", "id": rid}), zmq.NOBLOCK)
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
        """A request with one reply (stats, ping)."""
        rid = self.send(op)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg is not None and msg.get("id") == rid:
                return msg
        raise WorkerUnavailable(f"no reply to {op!r} from the worker at {self.endpoint} in {timeout_s}s")

    def stream(self, prompt: list[int], timeout_s: float = 60.0, **params: object) -> Iterator[dict]:
        """Token messages of one request until all its samples finished (heartbeats are not
        yielded). Raises WorkerUnavailable (see the module docstring) or ValueError (refused)."""
        self.check_reachable()
        rid = self.submit(prompt, **params)
        open_samples = set(range(max(1, int(params.get("n", 1)))))  # n < 1: wait for the refusal
        deadline = time.monotonic() + timeout_s
        manager_down_since: float | None = None
        try:
            while open_samples:
                now = time.monotonic()
                msg = self._next(min(deadline, now + self.liveness_s))
                if msg is None:
                    if time.monotonic() >= deadline:
                        raise WorkerUnavailable(f"the request did not finish within {timeout_s}s", "timeout")
                    raise WorkerUnavailable(f"the worker at {self.endpoint} sent nothing, not even a heartbeat, "
                                            f"for {self.liveness_s}s: it is stuck or paused", "silent")
                if msg.get("id") != rid:
                    continue
                if "error" in msg:
                    open_samples.clear()
                    raise ValueError(f"the worker refused the request: {msg['error']}")
                if msg.get("heartbeat"):
                    manager_down_since = self._check_waiting(msg.get("waiting"), manager_down_since)
                    continue
                manager_down_since = None
                if msg.get("finished"):
                    open_samples.discard(msg.get("index", 0))
                yield msg
        finally:
            if open_samples:
                self.abort(rid)

    def _check_waiting(self, reason: object, down_since: float | None) -> float | None:
        """Raises when a heartbeat says the request cannot move; returns when the manager was
        first reported unreachable (None: it is not)."""
        if reason == "draining":
            raise WorkerUnavailable("the manager is draining: it admits no new requests (an operator ran "
                                    "`kvpool drain`; `kvpool drain --cancel` ends it); retry later", "draining")
        if reason != "manager_unreachable":
            return None
        now = time.monotonic()
        if down_since is None:
            return now
        if now - down_since >= self.manager_grace_s:
            raise WorkerUnavailable(f"the worker cannot reach its manager (for {now - down_since:.0f}s); "
                                    "check `kvpool status` on the worker's host", "manager_unreachable")
        return down_since

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.sock.close(linger=200)  # a final abort still goes out
        self._monitor.close(linger=0)
        if self._own_ctx:
            self._ctx.term()
