"""The front door's connection to one worker's generate service (worker/server.py), asyncio.

One DEALER socket per worker; many requests in flight, each with its own queue of token
messages. A worker is taken for lost (every open request gets a ``lost`` message, which the
request turns into a clean error) when its socket disconnects (the process died: a socket
monitor sees it at once), or when it stayed silent for ``silence_s`` while requests were open
(it is pinged every ``PING_S`` meanwhile, and answers between steps).

CURVE (shared/curve.py): with ``curve`` keys the socket is a CURVE client of the worker. A
handshake the worker refuses (it does not allow this key, this client runs no CURVE while the
worker does, or the worker's public key is wrong) is seen at once by the socket monitor: the
link is lost with the reason and what to change, which the request's 503 carries and the log
says; it never waits for the silence timeout. A link is usable again only after a handshake
succeeds (the worker restarted, or re-read its allowed keys and ZeroMQ reconnected).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time

import msgpack
import zmq
import zmq.asyncio

from kvpool.frontend.errors import WorkerLost
from kvpool.shared.curve import ClientKeys

logger = logging.getLogger(__name__)
PING_S = 1.0
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def handshake_failure(event: int, value: int, curve: bool) -> str:
    """Why the worker refused the connection, and what to change."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"it refused this front door's CURVE key (ZAP status {value}): put the front door's public key "
                "(the NAME.key of its --curve-key-file) in the worker's curve_allowed_keys_dir and send the "
                "worker SIGHUP")
    if not curve:
        return ("the handshake failed: the worker runs CURVE and this front door does not; give it "
                "--worker-curve-key (the worker's NAME.key) and --curve-key-file")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (f"the CURVE handshake failed (ZMTP error {value:#x}): the worker may not run CURVE; drop "
                "--worker-curve-key for it, or configure the worker's curve_secret_key_file")
    return ("the CURVE handshake failed: --worker-curve-key is not the public key of the worker's "
            "curve_secret_key_file")


class WorkerLink:
    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context, silence_s: float = 30.0,
                 curve: ClientKeys | None = None, refused: str | None = None) -> None:
        """``refused``: why this front door will not connect (a link that stays lost)."""
        self.endpoint = endpoint
        self.silence_s = silence_s
        self.curve = curve
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        self._ids = itertools.count()
        self.queues: dict[str, asyncio.Queue] = {}
        self.last_heard = time.monotonic()
        self.lost: str | None = None
        if refused is None:
            self.sock.connect(endpoint)
        else:
            self.fail(refused)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch()),
                       asyncio.create_task(self._ping())]

    @property
    def running(self) -> int:
        return len(self.queues)

    def submit(self, prompt: list[int], params: dict, cache_salt: str | None = None) -> str:
        if self.lost is not None:
            raise WorkerLost(f"the worker at {self.endpoint} is gone: {self.lost}")
        rid = f"fd-{next(self._ids)}"
        self.queues[rid] = asyncio.Queue()
        msg = {"op": "generate", "id": rid, "prompt": prompt, "params": params}
        if cache_salt is not None:
            msg["cache_salt"] = cache_salt
        if self.running == 1:
            self.last_heard = time.monotonic()  # the silence clock starts with the first open request
        self._send(msg)
        return rid

    async def next(self, rid: str) -> dict:
        """The next message of request ``rid``; raises WorkerLost."""
        msg = await self.queues[rid].get()
        if "lost" in msg:
            raise WorkerLost(msg["lost"])
        return msg

    def done(self, rid: str) -> None:
        self.queues.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Stops ``rid`` on the worker (its blocks are freed at once); its messages are dropped."""
        if self.queues.pop(rid, None) is not None and self.lost is None:
            self._send({"op": "abort", "id": rid})

    def fail(self, reason: str) -> None:
        """Fails every open request; the first reason stays (a refused handshake is followed by
        a disconnect, and the refusal is what the operator must read)."""
        if self.lost is None:
            logger.warning("worker at %s lost: %s", self.endpoint, reason)
            self.lost = reason
        for q in self.queues.values():
            q.put_nowait({"lost": f"the worker at {self.endpoint} is gone ({self.lost})"})

    def _send(self, msg: dict) -> None:
        try:
            self.sock.send(_pack(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.fail("its socket does not take messages")

    async def _read(self) -> None:
        while True:
            payload = await self.sock.recv()
            self.last_heard = time.monotonic()
            try:
                msg = msgpack.unpackb(payload, raw=False)
            except (ValueError, msgpack.UnpackException):
                continue
            q = self.queues.get(msg.get("id")) if type(msg) is dict else None
            if q is not None:
                q.put_nowait(msg)

    async def _watch(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            event, value = struct.unpack("=hi", frames[0][:6])
            if event & HANDSHAKE_FAILED:
                self.fail(handshake_failure(event, value, self.curve is not None))
            elif event == zmq.EVENT_DISCONNECTED:
                self.fail("disconnected")
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.lost is not None and not self.queues:
                logger.info("worker at %s reachable again", self.endpoint)
                self.lost = None  # a worker is back at this endpoint (a restart): new requests may go

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(PING_S)
            if not self.queues or self.lost is not None:
                continue
            if time.monotonic() - self.last_heard > self.silence_s:
                self.fail(f"silent for {self.silence_s:.0f}s")
            else:
                self._send({"op": "ping", "id": "ping"})

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
