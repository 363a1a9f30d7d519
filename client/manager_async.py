"""The manager client, asyncio transport: the same core (client/manager_core.py) over a
``zmq.asyncio`` DEALER socket, for the front door's event loop.

Calls are coroutines; one request is in flight per client at a time (an ``asyncio.Lock``: the
manager answers a nil id to a message it cannot read, which only one request in flight makes
unambiguous), and waiting for a reply never blocks the loop, so no thread is needed. Ops,
replies, errors and retries are the sync client's (client/manager.py): the named ops
(``locate``, ``workers``, ``lookup``, ``stats``, ``step``) and ``call`` return coroutines.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from kvpool.client.manager_core import ManagerCore
from kvpool.client.retry import RetryPolicy
from kvpool.shared.curve import ClientKeys
from kvpool.shared.protocol import ManagerError, ManagerUnavailable


class AsyncManagerClient(ManagerCore):
    def __init__(self, endpoints: str | list[str], *, ctx: zmq.asyncio.Context | None = None,
                 role: str = "worker", identity: str | None = None, timeout_s: float = 5.0,
                 admin_key: str | None = None, failover_s: float = 30.0, curve: ClientKeys | None = None,
                 retry: RetryPolicy | None = None) -> None:
        """``ctx``: a shared asyncio context (else the client owns one)."""
        super().__init__(endpoints, role=role, identity=identity, timeout_s=timeout_s, admin_key=admin_key,
                         failover_s=failover_s, curve=curve, retry=retry)
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self._last_call = 0.0

    async def hello(self) -> dict:
        async with self._lock:
            return await self._hello()

    async def register(self, pool: str, *, shard_rank: int, shard_count: int, incarnation: str, spec: dict,
                       available_kv_bytes: int, host_kv_bytes: int = 0, host_kv_policy: str = "demote",
                       wait_s: float = 30.0, serve: dict | None = None, replace: bool = False) -> dict:
        """As ``ManagerClient.register``, without blocking the loop while it waits."""
        args = self._register_args(pool, shard_rank, shard_count, incarnation, spec, available_kv_bytes,
                                   host_kv_bytes, host_kv_policy, serve, replace)
        backoff = self.retry.with_deadline(wait_s).start()
        while True:
            try:
                body = await self.call("register", retry=True, **args)
            except ManagerError as e:
                body = self._holder_busy(e, pool, backoff)
            if self._registered(body, pool, shard_count, wait_s, backoff):
                return body
            await backoff.asleep()

    async def heartbeat(self) -> None:
        await self.call("heartbeat", retry=True)

    async def deregister(self) -> None:
        """Ends the session: the manager frees every request it still holds."""
        if self.sid is not None:
            try:
                await self.call("deregister")
            finally:
                self.sid = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._own_ctx:
            self._ctx.term()

    # -- plumbing --------------------------------------------------------------------------

    async def _call(self, op: str, pick: str | None, retry: bool, args: dict) -> Any:
        async with self._lock:
            if self.sid is None:
                await self._hello()
            body = self._check(await self._roundtrip(op, args, self.sid, retry))
        return body if pick is None else body[pick]

    async def _hello(self) -> dict:
        return self._on_hello(await self._roundtrip("hello", self._hello_args(), None, True))

    async def _roundtrip(self, op: str, args: dict, sid: str | None, retry: bool) -> dict:
        """One request, resent with the same id while that is safe (client/manager.py)."""
        msg_id = self._take_id()
        backoff = self.retry.start()
        while True:
            backoff.attempt()
            try:
                reply = await self._exchange(op, args, sid, msg_id)
            except ManagerUnavailable:
                if self._resend_unavailable(backoff, retry):
                    continue
                raise
            resend, switch, pause = self._resend_status(reply, backoff)
            if not resend:
                return reply
            if switch:
                self._next_endpoint()
            if pause:
                await asyncio.sleep(backoff.advance())

    def _next_endpoint(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ep = (self._ep + 1) % len(self.endpoints)

    async def _exchange(self, op: str, args: dict, sid: str | None, msg_id: int) -> dict:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve.apply(self._sock)
            self._sock.connect(self.endpoint)
        self._last_call = time.monotonic()
        try:
            await self._sock.send(self.encode(op, args, sid, msg_id), zmq.NOBLOCK)
        except zmq.Again:
            self._give_up(op)
        try:
            async with asyncio.timeout(self.timeout_s):
                while (reply := self._unpack(await self._sock.recv(), msg_id)) is None:
                    pass  # not the reply to this request (a late one, or not from a manager)
                return reply
        except TimeoutError:
            self._give_up(op)

    def _give_up(self, op: str) -> Any:
        """Drops the socket (a late reply must not answer a later call) and moves on."""
        endpoint = self.endpoint
        self._next_endpoint()
        raise ManagerUnavailable(self._unavailable_text(op, endpoint))
