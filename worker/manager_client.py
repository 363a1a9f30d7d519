"""The worker's side of the manager protocol (shared/protocol.py, PROTOCOL.md).

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

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvpool.shared.curve import ClientKeys
from kvpool.shared.protocol import (
    PROTOCOL_VERSION,
    ManagerError,
    ManagerRestarted,
    ManagerUnavailable,
    SessionExpired,
    StaleEpoch,
    encode_request,
    raise_for_reply,
    unpack,
)
from kvpool.worker.reply_receiver import Job, ReplyReceiver

__all__ = ["ManagerClient", "PendingCall", "ManagerError", "ManagerRestarted", "ManagerUnavailable", "SessionExpired", "StaleEpoch"]

logger = logging.getLogger(__name__)
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


class ManagerClient:
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
    ) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("need at least one manager endpoint (ipc://PATH or tcp://HOST:PORT)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.role, self.timeout_s, self.admin_key = role, timeout_s, admin_key
        self.failover_s = failover_s  # how long calls to a durable manager keep being resent
        # CURVE keys for a manager that requires them (shared/curve.py); default: the environment
        self.curve = curve if curve is not None else ClientKeys.from_env()
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}"
        self.sid: str | None = None
        self.session: int | None = None  # the public session number the admin lists show
        self.incarnation: str | None = None  # of the manager process last heard from
        self.state_id: str | None = None  # of the state this session lives in
        self.commit_seq = 0  # the highest commit sequence seen in that state (durable managers)
        self.durable = False
        self.hello_body: dict = {}
        self.heartbeat_interval_s = 1.0
        self.restarts = 0
        self.on_restart: Callable[[str | None, str | None], None] | None = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._ep = 0
        self._next_id = 1
        self._last_call = 0.0
        self._retrying = True  # False once shutting down: every call is tried once
        # begin_step's reply read and decoded during the caller's compute (worker/reply_receiver.py)
        self._receiver = ReplyReceiver(self._take) if receiver_thread else None
        self._job: Job | None = None  # the receiver's job in progress: the socket is its own until done

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._ep]

    # -- the protocol ----------------------------------------------------------------------

    def hello(self) -> dict:
        """Opens a session (done automatically by the first call that needs one)."""
        args: dict[str, Any] = {"identity": self.identity, "role": self.role, "versions": [PROTOCOL_VERSION]}
        if self.admin_key is not None:
            args["admin_key"] = self.admin_key
        reply = self._roundtrip("hello", args, None, retry=True)
        body = raise_for_reply(reply)
        old = self.state_id
        self.commit_seq = reply["seq"] if type(reply.get("seq")) is int else 0
        self.sid, self.session, self.incarnation = body["sid"], body["session"], body["incarnation"]
        self.state_id = body.get("state_id", self.incarnation)
        self.durable = bool(body.get("durable", False))
        self.heartbeat_interval_s = body.get("heartbeat_interval_s", 1.0)
        self.hello_body = body
        if old is not None and old != self.state_id:
            self._notify(old, self.state_id)  # noticed by hello itself: the caller is re-joining
        return body

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
    ) -> dict:
        """Registers one shard and waits until every shard of the pool has: returns
        {"num_blocks", "block_size", "epoch", ...}. Idempotent for the same incarnation.
        ``replace``: take the shard over even while another live session holds it."""
        args = {"pool": pool, "shard_rank": shard_rank, "shard_count": shard_count,
                "incarnation": incarnation, "spec": spec, "available_kv_bytes": available_kv_bytes}
        if host_kv_bytes:  # optional: a host tier for the pool (PROTOCOL.md, register)
            args["host_kv_bytes"] = host_kv_bytes
        if host_kv_policy != "demote":  # optional, default "demote" (PROTOCOL.md, register)
            args["host_kv_policy"] = host_kv_policy
        if serve is not None:  # {endpoint, model, max_model_len}: front doors find the worker by it
            args["serve"] = serve
        if replace:
            args["replace"] = True
        deadline = time.monotonic() + wait_s
        pause = 0.02
        while True:
            try:
                body = self.call("register", retry=True, **args)
            except ManagerError as e:
                # The shard is held by a live session (a previous process of this worker that has
                # not expired yet, or a second worker for the pool): wait for it, up to wait_s.
                if e.code != "not_owner" or time.monotonic() >= deadline:
                    raise
                logger.warning("pool %s: %s; retrying until the holder's session ends", pool, e.message)
                body = {}
            if body.get("state") == "ready":
                return body
            if time.monotonic() >= deadline:
                raise ManagerError("register_timeout", f"pool {pool!r}: {body.get('registered')} of "
                                   f"{shard_count} shards registered after {wait_s}s; start the other shards")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)

    def step(self, pool: str, epoch: int, ops: list[dict]) -> list[dict]:
        """Runs one scheduler step's sub-ops (manager/core/step.py schemas) in one round trip."""
        return self.call("step", pool=pool, epoch=epoch, ops=ops)["results"]

    def begin_step(self, pool: str, epoch: int, ops: list[dict]) -> PendingCall:
        """Sends a step and returns at once; ``end_step`` waits for its results."""
        if self.sid is None:
            self.hello()
        pending = PendingCall("step", {"pool": pool, "epoch": epoch, "ops": ops}, self.sid, self._next_id)
        self._next_id += 1
        try:
            self._send(pending.op, pending.args, pending.sid, pending.msg_id)
            pending.sent = True
        except ManagerUnavailable:
            return pending  # end_step sends it again (or gives up) the way a call would
        if self._receiver is not None and self._sock is not None:
            self._job = pending.job = self._receiver.start(self._sock, self._last_call + self.timeout_s, pending.msg_id)
        return pending

    def end_step(self, pending: PendingCall) -> list[dict]:
        reply = self._roundtrip(pending.op, pending.args, pending.sid, retry=False, msg_id=pending.msg_id,
                                sent=pending.sent, job=pending.job)
        return self._check(reply)["results"]

    def lookup(self, pool: str, hashes: list[bytes]) -> int:
        return self.call("lookup", retry=True, pool=pool, hashes=hashes)["blocks"]

    def locate(self, hashes: list[bytes]) -> dict[str, int]:
        return self.call("locate", retry=True, hashes=hashes)["pools"]

    def workers(self) -> list[dict]:
        """Ready pools that serve generate requests: [{pool, model, endpoint, max_model_len, ...}]."""
        return self.call("workers", retry=True)["workers"]

    def heartbeat(self) -> None:
        self.call("heartbeat", retry=True)

    def maybe_heartbeat(self) -> bool:
        """Heartbeats when nothing was sent for heartbeat_interval_s; call it from idle loops."""
        if self.sid is not None and time.monotonic() - self._last_call < self.heartbeat_interval_s:
            return False
        self.heartbeat()
        return True

    def stats(self) -> dict:
        return self.call("stats", retry=True)

    def deregister(self) -> None:
        """Ends the session: the manager frees every request it still holds."""
        if self.sid is not None:
            try:
                self.call("deregister")
            finally:
                self.sid = None

    def stop_retrying(self) -> None:
        """From now on every call is tried once (safe from a signal handler): a process that is
        stopping must not wait out ``failover_s`` for a manager that may never come back."""
        self._retrying = False

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

    def call(self, op: str, *, retry: bool = False, **args: Any) -> dict:
        """Any op by name (admin ops included); returns the reply body or raises."""
        if self.sid is None:
            self.hello()
        return self._check(self._roundtrip(op, args, self.sid, retry=retry))

    def _check(self, reply: dict) -> dict:
        """The reply's body; raises when the session or the manager's state is gone."""
        inc = reply.get("inc")
        state = reply.get("state", inc)
        if isinstance(inc, str):
            self.incarnation = inc
        seen = self.commit_seq
        went_back = self._went_back(state, reply.get("seq"))
        if went_back or state != self.state_id or reply.get("status") == "unknown_session":
            old = self.state_id
            self.sid, self.state_id = None, state if isinstance(state, str) else None
            self._notify(old, state, went_back)
            if went_back:
                raise ManagerRestarted(old, state, f"the manager's state {state} went back from commit {seen} to "
                                       f"{reply['seq']}: acknowledged steps were lost; abort and register again")
            if state != old:
                raise ManagerRestarted(old, state)
            raise SessionExpired(inc, "the manager expired this session: its requests were freed; register again")
        return raise_for_reply(reply)

    def _went_back(self, state: object, seq: object) -> bool:
        """Keeps the highest commit sequence seen in the current state; True when ``seq`` of that
        same state is below it (the manager serves an older copy: PROTOCOL.md section 11)."""
        if type(seq) is not int:
            return False
        went_back = state == self.state_id and seq < self.commit_seq
        if went_back or state != self.state_id or seq > self.commit_seq:
            self.commit_seq = seq
        return went_back

    def _notify(self, old: str | None, new: str | None, went_back: bool = False) -> None:
        """The session is gone (old == new: it expired, or the state went back; else the manager restarted)."""
        self.restarts += old != new or went_back
        logger.warning("manager session lost (incarnation %s -> %s): requests must be aborted", old, new)
        if self.on_restart is not None:
            self.on_restart(old, new)

    def _roundtrip(self, op: str, args: dict, sid: str | None, *, retry: bool, msg_id: int | None = None,
                   sent: bool = False, job: Job | None = None) -> dict:
        """One request, resent with the same id while that is safe (see the module docstring).
        ``sent``: its first copy already went out (``begin_step``): wait for that one first
        (``job``: the receiver thread is taking it)."""
        if msg_id is None:
            msg_id = self._next_id
            self._next_id += 1
        deadline = time.monotonic() + self.failover_s
        attempts, pause = 0, 0.02
        while True:
            attempts += 1
            try:
                if sent:
                    sent = False
                    reply = self._receive(op, msg_id, job)
                else:
                    reply = self._exchange(op, args, sid, msg_id)
            except ManagerUnavailable:
                if not self._retrying:
                    raise
                if (self.durable and time.monotonic() < deadline) or (retry and attempts < len(self.endpoints)):
                    continue
                raise
            status = reply.get("status")
            if status not in ("not_active", "store_unavailable") or time.monotonic() >= deadline or not self._retrying:
                return reply
            if status == "not_active":
                self._next_endpoint()
            if status == "store_unavailable" or attempts % len(self.endpoints) == 0:
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

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
            self._sock.send(encode_request(msg_id, op, sid, args, self.commit_seq), zmq.NOBLOCK)
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

    @staticmethod
    def _take(sock: zmq.Socket, deadline: float, msg_id: int) -> dict | None:
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
            try:
                reply = unpack(raw)
            except Exception:  # not msgpack: not from a manager; keep waiting
                continue
            if type(reply) is not dict:
                continue
            # A nil id answers a request the manager could not read (too large, not decodable):
            # with one request in flight on this socket, it is this one (PROTOCOL.md section 2).
            if reply.get("id") == msg_id or (reply.get("id") is None and reply.get("status") != "ok"):
                return reply

    def _give_up(self, op: str) -> Any:
        """Drops the socket (a late reply must not answer a later call) and moves on."""
        endpoint = self.endpoint
        self._next_endpoint()
        raise ManagerUnavailable(
            f"no reply to {op!r} from the manager at {endpoint} within {self.timeout_s}s: is it running? "
            "(start it with `kvpool manager`, or point --manager / KVPOOL_MANAGER at it)"
        )
