"""Client of the worker's generate service (worker/server.py): `kvpool generate`, the demo."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import msgpack
import zmq

from kvpool.shared.curve import ClientKeys


class WorkerUnavailable(RuntimeError):
    pass


class GenerateClient:
    """One DEALER socket to one worker; many requests may be in flight at once."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None, curve: ClientKeys | None = None) -> None:
        """``curve``: the worker's public key and this client's keys, when the worker runs CURVE."""
        self.endpoint = endpoint
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(endpoint)
        self._ids = itertools.count()

    def send(self, op: str, **body: object) -> str:
        rid = str(body.pop("id", None) or f"{op}-{next(self._ids)}")
        try:  # a socket whose connection was refused (CURVE) has nowhere to queue: never block
            self.sock.send(msgpack.packb({"op": op, "id": rid, **body}, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            raise WorkerUnavailable(f"cannot send to the worker at {self.endpoint}: no connection (refused by "
                                    "its CURVE keys, or its queue is full); open a new client") from None
        return rid

    def submit(self, prompt: list[int], **params: object) -> str:
        return self.send("generate", prompt=list(prompt), params=params)

    def recv(self, timeout_s: float) -> dict | None:
        if not self.sock.poll(timeout_s * 1000, zmq.POLLIN):
            return None
        return msgpack.unpackb(self.sock.recv(), raw=False)

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
        """Token messages of one request until all its samples finished."""
        rid = self.submit(prompt, **params)
        open_samples = {i: True for i in range(int(params.get("n", 1)))}
        while open_samples:
            msg = self.recv(timeout_s)
            if msg is None:
                raise WorkerUnavailable(f"the worker at {self.endpoint} sent nothing for {timeout_s}s")
            if msg.get("id") != rid:
                continue
            if "error" in msg:
                raise ValueError(f"the worker refused the request: {msg['error']}")
            yield msg
            if msg.get("finished"):
                open_samples.pop(msg.get("index", 0), None)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()
