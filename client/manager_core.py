"""The manager protocol's client side without I/O: what both transports share.

``ManagerCore`` holds a session's state (sid, session number, the manager's incarnation and
state id, the highest commit sequence seen, durability), builds every request (``encode``),
reads every reply (``_check``: restarts, expiry, a state that went back, errors) and decides
retries under one ``RetryPolicy`` (client/retry.py). The sync ``ManagerClient``
(client/manager.py) and the asyncio ``AsyncManagerClient`` (client/manager_async.py) add a
socket and a clock; the named ops here return what the transport's ``_call`` returns (a value,
or for asyncio a coroutine of it), as redis-py shares its commands between ``redis`` and
``redis.asyncio``. Failures: see client/manager.py's docstring.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from kvpool.client.retry import Backoff, RetryPolicy
from kvpool.shared.curve import ClientKeys
from kvpool.shared.protocol import (
    PROTOCOL_VERSION,
    ManagerError,
    ManagerRestarted,
    SessionExpired,
    encode_request,
    raise_for_reply,
    unpack,
)

logger = logging.getLogger(__name__)
RETRIED = ("not_active", "store_unavailable")  # statuses a call is resent on (PROTOCOL.md section 11)


class ManagerCore:
    def __init__(self, endpoints: str | list[str], *, role: str = "worker", identity: str | None = None,
                 timeout_s: float = 5.0, admin_key: str | None = None, failover_s: float = 30.0,
                 curve: ClientKeys | None = None, retry: RetryPolicy | None = None) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("need at least one manager endpoint (ipc://PATH or tcp://HOST:PORT)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.role, self.timeout_s, self.admin_key = role, timeout_s, admin_key
        # how calls are resent: to a durable manager until deadline_s (failover_s) has passed
        self.retry = (retry or RetryPolicy()).with_deadline(failover_s)
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
        self._ep = 0
        self._next_id = 1
        self._retrying = True  # False once shutting down: every call is tried once

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._ep]

    @property
    def failover_s(self) -> float:
        """How long calls to a durable manager keep being resent."""
        return self.retry.deadline_s or 0.0

    @failover_s.setter
    def failover_s(self, value: float) -> None:
        self.retry = self.retry.with_deadline(value)

    def forget_session(self) -> None:
        """The session is given up (its manager stopped answering, or is going away): nothing
        is sent for it any more (no heartbeat, no deregister); the next call opens a new one."""
        self.sid = None

    def stop_retrying(self) -> None:
        """From now on every call is tried once (safe from a signal handler): a process that is
        stopping must not wait out ``failover_s`` for a manager that may never come back."""
        self._retrying = False

    # -- the named ops (the transport's ``_call`` does the I/O) ------------------------------

    def _call(self, op: str, pick: str | None, retry: bool, args: dict) -> Any:
        raise NotImplementedError

    def call(self, op: str, *, retry: bool = False, **args: Any) -> Any:
        """Any op by name (admin ops included); returns the reply body or raises."""
        return self._call(op, None, retry, args)

    def step(self, pool: str, epoch: int, ops: list) -> Any:
        """Runs one scheduler step's sub-ops (manager/core/step.py schemas) in one round trip;
        ``ops`` travel as the caller encoded them."""
        return self._call("step", "results", False, {"pool": pool, "epoch": epoch, "ops": ops})

    def lookup(self, pool: str, hashes: list[bytes]) -> Any:
        return self._call("lookup", "blocks", True, {"pool": pool, "hashes": hashes})

    def locate(self, hashes: list[bytes]) -> Any:
        return self._call("locate", "pools", True, {"hashes": hashes})

    def workers(self) -> Any:
        """Ready pools that serve generate requests: [{pool, model, endpoint, max_model_len, ...}]."""
        return self._call("workers", "workers", True, {})

    def stats(self) -> Any:
        return self._call("stats", None, True, {})

    # -- messages ----------------------------------------------------------------------------

    def _take_id(self) -> int:
        msg_id, self._next_id = self._next_id, self._next_id + 1
        return msg_id

    def encode(self, op: str, args: dict, sid: str | None, msg_id: int) -> bytes:
        return encode_request(msg_id, op, sid, args, self.commit_seq)

    def _hello_args(self) -> dict:
        args: dict[str, Any] = {"identity": self.identity, "role": self.role, "versions": [PROTOCOL_VERSION]}
        if self.admin_key is not None:
            args["admin_key"] = self.admin_key
        return args

    def _on_hello(self, reply: dict) -> dict:
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

    @staticmethod
    def _register_args(pool: str, shard_rank: int, shard_count: int, incarnation: str, spec: dict,
                       available_kv_bytes: int, host_kv_bytes: int, host_kv_policy: str, serve: dict | None,
                       replace: bool, node_model: str | None = None) -> dict:
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
        if node_model is not None:  # the weights' identity: the pool may use the node tier of its layout
            args["node_model"] = node_model
        return args

    @staticmethod
    def _holder_busy(e: ManagerError, pool: str, backoff: Backoff) -> dict:
        """The shard is held by a live session (a previous process of this worker that has not
        expired yet, or a second worker for the pool): wait for it, up to the deadline."""
        if e.code != "not_owner" or backoff.expired():
            raise e
        logger.warning("pool %s: %s; retrying until the holder's session ends", pool, e.message)
        return {}

    @staticmethod
    def _registered(body: dict, pool: str, shard_count: int, wait_s: float, backoff: Backoff) -> bool:
        """True once every shard registered; raises ``register_timeout`` after ``wait_s``."""
        if body.get("state") == "ready":
            return True
        if backoff.expired():
            raise ManagerError("register_timeout", f"pool {pool!r}: {body.get('registered')} of "
                               f"{shard_count} shards registered after {wait_s}s; start the other shards")
        return False

    # -- replies -----------------------------------------------------------------------------

    @staticmethod
    def _unpack(raw: bytes, msg_id: int) -> dict | None:
        """The reply to ``msg_id`` in ``raw``, or None for anything else (keep reading)."""
        try:
            reply = unpack(raw)
        except Exception:  # not msgpack: not from a manager
            return None
        if type(reply) is not dict:
            return None
        # A nil id answers a request the manager could not read (too large, not decodable): with
        # one request in flight on this socket, it is this one (PROTOCOL.md section 2).
        if reply.get("id") == msg_id or (reply.get("id") is None and reply.get("status") != "ok"):
            return reply
        return None

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

    # -- retries -----------------------------------------------------------------------------

    def _resend_unavailable(self, backoff: Backoff, retry: bool) -> bool:
        """After no reply: resend? A durable manager's calls until the deadline; a read-only
        call (``retry``) once to each endpoint; nothing once shutting down."""
        if not self._retrying:
            return False
        return (self.durable and not backoff.expired()) or (retry and backoff.tries < len(self.endpoints))

    def _resend_status(self, reply: dict, backoff: Backoff) -> tuple[bool, bool, bool]:
        """After a reply: (resend it, move to the next endpoint first, pause first)."""
        status = reply.get("status")
        if status not in RETRIED or backoff.expired() or not self._retrying:
            return False, False, False
        switch = status == "not_active"
        return True, switch, status == "store_unavailable" or backoff.tries % len(self.endpoints) == 0

    def _unavailable_text(self, op: str, endpoint: str) -> str:
        return (f"no reply to {op!r} from the manager at {endpoint} within {self.timeout_s}s: is it running? "
                "(start it with `kvpool manager`, or point --manager / KVPOOL_MANAGER at it)")
