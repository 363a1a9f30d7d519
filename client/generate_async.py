"""The generate client, asyncio transport: the front door's link to one worker's generate
service (worker/server.py), over the core the sync ``GenerateClient`` uses (client/generate_core.py).

One DEALER socket per worker; many requests in flight, each with its own queue of token
messages. A worker is taken for lost (every open request gets a ``lost`` message, which the
request turns into a clean error) when its socket disconnects (the process died: a socket
monitor sees it at once), or when it stayed silent for ``silence_s`` while requests were open
(it is pinged every ``PING_S`` meanwhile, and answers between steps).

Nothing is dropped on the way out: a message the socket does not take now (ZeroMQ's pipe to a
worker that reads slower than requests come, a burst, a paused worker) waits in the link's
outbox and goes out in order as the pipe drains; requests and pings keep their order, which the
pings' reconciliation relies on. (pyzmq's asyncio ``send`` never raises for a full pipe: its
future holds the error, so a send that is not awaited loses the message silently.)

CURVE (shared/curve.py): with ``curve`` keys the socket is a CURVE client of the worker. A
handshake the worker refuses (it does not allow this key, this client runs no CURVE while the
worker does, or the worker's public key is wrong) is seen at once by the socket monitor: the
link is lost with the reason and what to change, which the request's 503 carries and the log
says; it never waits for the silence timeout. A link is usable again only after a handshake
succeeds (the worker restarted, or re-read its allowed keys and ZeroMQ reconnected).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvpool.client.generate_core import GenerateCore, WorkerLost
from kvpool.shared.curve import ClientKeys
from kvpool.shared.generate import Pong, Reply, parse_reply

logger = logging.getLogger(__name__)
PING_S = 1.0
# Awaiting a recv with a message already waiting never suspends (pyzmq hands back a done future),
# so while a worker sends faster than the front door reads, the reader never let the event loop
# run: no timer, no HTTP request and no disconnect check until the burst ended (at load 15 a
# client that left a 15,360-token request went unnoticed to its last token). It yields every
# READ_BURST messages.
READ_BURST = 32
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


@dataclass(frozen=True)
class Lost:
    """Put on an open request's queue when its worker is taken for lost."""

    reason: str


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
        self._core = GenerateCore("fd")
        self.queues: dict[str, asyncio.Queue[Reply | Lost]] = {}
        self._pings = 0  # pings sent; a request remembers how many were sent before it
        self._submitted: dict[str, int] = {}
        self.last_heard = time.monotonic()
        self.lost: str | None = None
        self._outbox: deque[bytes] = deque()  # what the socket did not take yet, in order
        self._outbox_ready = asyncio.Event()
        if refused is None:
            self.sock.connect(endpoint)
        else:
            self.fail(refused)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch()),
                       asyncio.create_task(self._ping()), asyncio.create_task(self._flush())]

    @property
    def running(self) -> int:
        return len(self.queues)

    def submit(self, prompt: list[int], params: Mapping[str, Any], cache_salt: str | None = None) -> str:
        if self.lost is not None:
            raise WorkerLost(f"the worker at {self.endpoint} is gone: {self.lost}")
        rid, payload = self._core.generate(prompt, params, cache_salt)
        self.queues[rid] = asyncio.Queue()
        self._submitted[rid] = self._pings
        if self.running == 1:
            self.last_heard = time.monotonic()  # the silence clock starts with the first open request
        self._send(payload)
        return rid

    async def next(self, rid: str) -> Reply:
        """The next message of request ``rid`` (shared/generate.py's records); raises WorkerLost."""
        msg = await self.queues[rid].get()
        if isinstance(msg, Lost):
            raise WorkerLost(msg.reason)
        return msg

    def done(self, rid: str) -> None:
        self.queues.pop(rid, None)
        self._submitted.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Stops ``rid`` on the worker (its blocks are freed at once); its messages are dropped."""
        self._submitted.pop(rid, None)
        if self.queues.pop(rid, None) is not None and self.lost is None:
            self._send(self._core.control("abort", rid)[1])

    def fail(self, reason: str) -> None:
        """Fails every open request; the first reason stays (a refused handshake is followed by
        a disconnect, and the refusal is what the operator must read)."""
        if self.lost is None:
            logger.warning("worker at %s lost: %s", self.endpoint, reason)
            self.lost = reason
        for q in self.queues.values():
            q.put_nowait(Lost(f"the worker at {self.endpoint} is gone ({self.lost})"))

    def _send(self, payload: bytes) -> None:
        """Sends now, or queues behind what is already waiting (the order is the protocol's)."""
        if not self._outbox:
            sent = self.sock.send(payload, zmq.NOBLOCK)  # a done future: the error, if any, is in it
            error = sent.exception() if sent.done() else None
            if error is None:
                return
            if not isinstance(error, zmq.Again):
                self.fail(f"its socket refused a message ({error})")
                return
        self._outbox.append(payload)
        self._outbox_ready.set()

    async def _flush(self) -> None:
        """Sends the outbox in order, each message as soon as the pipe takes it."""
        while True:
            await self._outbox_ready.wait()
            while self._outbox:  # not empty while a send waits: _send's fast path never overtakes it
                await self.sock.send(self._outbox[0])
                self._outbox.popleft()
            self._outbox_ready.clear()

    async def _read(self) -> None:
        burst = 0
        while True:
            payload = await self.sock.recv()
            burst += 1
            if burst == READ_BURST:
                burst = 0
                await asyncio.sleep(0)
            self.last_heard = time.monotonic()
            try:
                msg = msgpack.unpackb(payload, raw=False)
            except (ValueError, msgpack.UnpackException):
                continue
            reply = parse_reply(msg)
            if isinstance(reply, Pong):
                self._reconcile(reply)
                continue
            q = self.queues.get(reply.client_id) if reply is not None else None
            if q is not None:
                q.put_nowait(reply)

    def _reconcile(self, pong: Pong) -> None:
        """Requests open here but not at the worker, though sent before this ping (one pipe keeps
        order): their remaining messages will never come. They fail now, so no client waits and
        no router counts them as load."""
        if pong.open is None or not pong.client_id.startswith("ping-"):
            return
        try:
            ping = int(pong.client_id.removeprefix("ping-"))
        except ValueError:
            return
        known = set(pong.open)
        for rid, at in list(self._submitted.items()):
            if at < ping and rid not in known and rid in self.queues:  # (a request that just ended reads its
                self._submitted.pop(rid)                               # last message first, never this)
                self.queues[rid].put_nowait(Lost(f"the worker at {self.endpoint} no longer knows this request "
                                                 "(its messages were lost)"))

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
                self._pings += 1
                self._send(self._core.control("ping", f"ping-{self._pings}")[1])

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
