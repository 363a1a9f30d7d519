"""The manager client, sync transport (shared/protocol.py, PROTOCOL.md; the asyncio one is
client/manager_async.py, both over client/manager_core.py).

One DEALER socket, one request in flight, one round trip per call: a scheduler step's sub-ops
travel in a single ``step`` message. ``begin_step`` sends a step without waiting and
``end_step`` collects its answer, so a worker computes while the manager works (nothing else
may be called in between). Not thread-safe; use one client per thread.

Failures, as exceptions (all ``ManagerError``):
- ``ManagerUnavailable``: no reply within ``timeout_s``. The socket is replaced (so a late reply
  cannot be mistaken for a later call's) and the next endpoint is used. Without persistence
  ``step`` is never retried (it is not idempotent); read-only calls and register try each
  endpoint once. A *durable* manager (hello said so; PROTOCOL.md section 11) answers a resent
  step from its reply cache, so every call, step included, is resent with the same id across
  timeouts, ``store_unavailable`` and ``not_active`` (next endpoint: failover) for up to
  ``failover_s``; only then does ManagerUnavailable reach the caller.
- ``ManagerRestarted``: the manager's state id changed (without persistence: it restarted), or
  its commit sequence went below one this client saw in the same state (an older copy of the
  state is served: acknowledged steps were lost), so this session, its registrations and its
  requests are gone. ``SessionExpired`` (a subclass): the manager timed this session out.
  Either way the caller aborts its running requests and calls ``register`` again (which says
  hello first). ``on_restart(old, new)`` is called before the exception is raised (``old ==
  new`` for an expired session); ``restarts`` counts incarnation changes.
- ``StaleEpoch``: a shard of the pool restarted; call ``register`` again to learn the new epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from kvpool.client.manager_core import ManagerCore
from kvpool.client.reply_receiver import Job, ReplyReceiver
from kvpool.client.retry import Backoff, RetryPolicy
from kvpool.shared.curve import ClientKeys
from kvpool.shared.protocol import (
    ManagerError,
    ManagerRestarted,
    ManagerUnavailable,
    SessionExpired,
    StaleEpoch,
)

__all__ = ["ManagerClient", "PendingCall", "ManagerError", "ManagerRestarted", "ManagerUnavailable", "SessionExpired", "StaleEpoch"]

_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: cheaper than enums


@dataclass
class PendingCall:
    """A call sent by ``begin_step`` whose reply ``end_step`` collects."""

    op: str
    args: dict
    sid: str | None
    msg_id: int
    sent: bool = False
    job: Job | None = None  # the receiver thread taking its reply, if the client has one


class ManagerClient(ManagerCore):
    def __init__(
        self,
        endpoints: str | list[str],
        *,
        role: str = "worker",
        identity: str | None = None,
        timeout_s: float = 5.0,
        admin_key: str | None = None,
        failover_s: float = 30.0,
        curve: ClientKeys | None = None,
        receiver_thread: bool = False,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(endpoints, role=role, identity=identity, timeout_s=timeout_s, admin_key=admin_key,
                         failover_s=failover_s, curve=curve, retry=retry)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._last_call = 0.0
        # begin_step's reply read and decoded during the caller's compute (client/reply_receiver.py)
        self._receiver = ReplyReceiver(self._take) if receiver_thread else None
        self._job: Job | None = None  # the receiver's job in progress: the socket is its own until done

    # -- the protocol ----------------------------------------------------------------------

    def hello(self) -> dict:
        """Opens a session (done automatically by the first call that needs one)."""
        return self._on_hello(self._roundtrip("hello", self._hello_args(), None, retry=True))

    def register(
        self,
        pool: str,
        *,
        shard_rank: int,
        shard_count: int,
        incarnation: str,
        spec: dict,
        available_kv_bytes: int,
        host_kv_bytes: int = 0,
        host_kv_policy: str = "demote",
        wait_s: float = 30.0,
        serve: dict | None = None,
        replace: bool = False,
        node_model: str | None = None,
    ) -> dict:
        """Registers one shard and waits until every shard of the pool has: returns
        {"num_blocks", "block_size", "epoch", ...}. Idempotent for the same incarnation.
        ``replace``: take the shard over even while another live session holds it."""
        args = self._register_args(pool, shard_rank, shard_count, incarnation, spec, available_kv_bytes,
                                   host_kv_bytes, host_kv_policy, serve, replace, node_model)
        backoff = self.retry.with_deadline(wait_s).start()
        while True:
            try:
                body = self.call("register", retry=True, **args)
            except ManagerError as e:
                body = self._holder_busy(e, pool, backoff)
            if self._registered(body, pool, shard_count, wait_s, backoff):
                return body
            backoff.sleep()

    def begin_step(self, pool: str, epoch: int, ops: list, node_done: list | None = None) -> PendingCall:
        """Sends a step and returns at once; ``end_step`` waits for its results. ``node_done``:
        reports of node-tier batches run since the last step (PROTOCOL.md, step)."""
        if self.sid is None:
            self.hello()
        args = {"pool": pool, "epoch": epoch, "ops": ops}
        if node_done:
            args["node_done"] = node_done
        pending = PendingCall("step", args, self.sid, self._take_id())
        try:
            self._send(pending.op, pending.args, pending.sid, pending.msg_id)
            pending.sent = True
        except ManagerUnavailable:
            return pending  # end_step sends it again (or gives up) the way a call would
        if self._receiver is not None and self._sock is not None:
            self._job = pending.job = self._receiver.start(self._sock, self._last_call + self.timeout_s, pending.msg_id)
        return pending

    def end_step(self, pending: PendingCall) -> list:
        reply = self._roundtrip(pending.op, pending.args, pending.sid, retry=False, msg_id=pending.msg_id,
                                sent=pending.sent, job=pending.job)
        return self._check(reply)["results"]

    def heartbeat(self) -> None:
        self.call("heartbeat", retry=True)

    def maybe_heartbeat(self) -> bool:
        """Heartbeats when nothing was sent for heartbeat_interval_s; call it from idle loops."""
        if self.sid is not None and time.monotonic() - self._last_call < self.heartbeat_interval_s:
            return False
        self.heartbeat()
        return True

    def deregister(self) -> None:
        """Ends the session: the manager frees every request it still holds."""
        if self.sid is not None:
            try:
                self.call("deregister")
            finally:
                self.sid = None

    def close(self) -> None:
        self._settle()
        if self._receiver is not None:
            self._receiver.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.deregister()
        except ManagerError:
            pass
        finally:
            self.close()

    # -- plumbing --------------------------------------------------------------------------

    def _call(self, op: str, pick: str | None, retry: bool, args: dict) -> Any:
        if self.sid is None:
            self.hello()
        body = self._check(self._roundtrip(op, args, self.sid, retry=retry))
        return body if pick is None else body[pick]

    def _roundtrip(self, op: str, args: dict, sid: str | None, *, retry: bool, msg_id: int | None = None,
                   sent: bool = False, job: Job | None = None) -> dict:
        """One request, resent with the same id while that is safe (see the module docstring).
        ``sent``: its first copy already went out (``begin_step``): wait for that one first
        (``job``: the receiver thread is taking it)."""
        if msg_id is None:
            msg_id = self._take_id()
        backoff: Backoff = self.retry.start()
        while True:
            backoff.attempt()
            try:
                if sent:
                    sent = False
                    reply = self._receive(op, msg_id, job)
                else:
                    reply = self._exchange(op, args, sid, msg_id)
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
                time.sleep(backoff.advance())

    def _settle(self) -> Job | None:
        """Waits until the receiver thread is done with the socket (a step whose end_step was
        never called: its reply comes, or its deadline passes); returns its job."""
        job, self._job = self._job, None
        if job is not None:
            job.wait()
        return job

    def _next_endpoint(self) -> None:
        self._settle()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ep = (self._ep + 1) % len(self.endpoints)

    def _exchange(self, op: str, args: dict, sid: str | None, msg_id: int) -> dict:
        self._send(op, args, sid, msg_id)
        return self._receive(op, msg_id)

    def _send(self, op: str, args: dict, sid: str | None, msg_id: int) -> None:
        self._settle()
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve.apply(self._sock)
            self._sock.connect(self.endpoint)
        self._last_call = time.monotonic()
        try:
            self._sock.send(self.encode(op, args, sid, msg_id), zmq.NOBLOCK)
        except zmq.Again:
            self._give_up(op)

    def _receive(self, op: str, msg_id: int, job: Job | None = None) -> dict:
        """The reply to ``msg_id``, within timeout_s of its sending (from ``job`` when the
        receiver thread took it)."""
        if job is not None and self._settle() is job:
            reply = job.reply
        else:
            reply = self._take(self._sock, self._last_call + self.timeout_s, msg_id) if self._sock else None
        if reply is None:
            self._give_up(op)
        return reply  # type: ignore[return-value]

    @classmethod
    def _take(cls, sock: zmq.Socket, deadline: float, msg_id: int) -> dict | None:
        """Reads ``sock`` until the reply to ``msg_id`` (None at ``deadline``). Touches no client
        state: the receiver thread runs it too."""
        while True:
            # A reply that came during the caller's work is read without a poll; asking the socket
            # first costs less than the exception of a recv that finds nothing (the usual case
            # right after sending).
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                if (left := deadline - time.monotonic()) <= 0 or not sock.poll(left * 1000, _POLLIN):
                    return None
            try:
                raw = sock.recv(_NOBLOCK)
            except zmq.Again:
                continue
            if (reply := cls._unpack(raw, msg_id)) is not None:
                return reply

    def _give_up(self, op: str) -> Any:
        """Drops the socket (a late reply must not answer a later call) and moves on."""
        endpoint = self.endpoint
        self._next_endpoint()
        raise ManagerUnavailable(self._unavailable_text(op, endpoint))
