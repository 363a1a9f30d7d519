"""One message through the manager, without sockets: decode, validate, dispatch, answer.

``Dispatcher.handle`` turns one payload into an ``Answer`` (manager/ops.py), or None when a
forked check answers it later; ``handle_frames`` first checks the ROUTER envelope around it. The op table is manager/ops.py's ``OPS``, filled where the
handlers are defined (manager/handlers.py); each handler gets a ``Call``. Nothing a client sends
escapes as an exception: bad input becomes an error answer and changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpool.manager.check_job import CheckJobs, Waiter
from kvpool.manager.handlers import Handlers
from kvpool.manager.ops import OPS, Answer, Call
from kvpool.manager.registry import Registry
from kvpool.manager.state.entries import Session
from kvpool.manager.stats import ServerStats
from kvpool.manager.store.recovery import INACTIVE, Recovery
from kvpool.shared.protocol import SUPPORTED_VERSIONS, ManagerError, short_repr, unpack

logger = logging.getLogger(__name__)
NO_WHO = (-1, -1, "")  # a message that named no session, id or known op (manager/message_times.py)


class Dispatcher:
    def __init__(self, registry: Registry, handlers: Handlers, stats: ServerStats, recovery: Recovery,
                 checks: CheckJobs, *, max_message_bytes: int, max_objects: int,
                 admin_key_missing: bool) -> None:
        self.registry, self.handlers, self.stats = registry, handlers, stats
        self.recovery, self.checks = recovery, checks
        self.max_message_bytes, self.max_objects = max_message_bytes, max_objects
        self.admin_key_missing = admin_key_missing
        self.who = NO_WHO  # (session number, message id, op) of the message handled last

    def handle_frames(self, frames: list[bytes], now: float) -> Answer | None:
        """[routing-id, payload] or [routing-id, b"", payload] -> its answer, not yet encoded;
        None to drop a malformed envelope (counted), or when a forked check answers it later."""
        if len(frames) == 2 or (len(frames) == 3 and not frames[1]):
            return self.handle(frames[-1], now, tuple(frames[:-1]))
        self.stats.dropped += 1
        return None

    def handle(self, payload: bytes, now: float, envelope: tuple[bytes, ...] | None = None) -> Answer | None:
        """Decodes, validates and dispatches one request; its answer, or None when a forked
        check answers it later (only with the ``envelope`` its reply needs)."""
        self.who = NO_WHO
        self.stats.messages += 1
        msg_id = None
        reg = self.registry
        inc, state, seq = reg.incarnation, reg.state_id, None
        try:
            if len(payload) > self.max_message_bytes:
                raise ManagerError("too_large", f"{len(payload)} bytes; the limit is {self.max_message_bytes}")
            try:
                msg = unpack(payload, self.max_objects)
            except Exception as e:  # msgpack raises several types; none may escape
                raise ManagerError("bad_message", f"payload is not one msgpack value: {e}") from None
            if type(msg) is not dict:
                raise ManagerError("bad_message", f"a request must be a msgpack map, got {type(msg).__name__}")
            msg_id = msg.get("id")
            if type(msg_id) is not int or not 0 <= msg_id < 1 << 64:
                msg_id = None
                raise ManagerError("bad_message", "field 'id' must be a uint64")
            if self.recovery.mode != "active":
                raise ManagerError(*INACTIVE[self.recovery.mode])
            seq = reg.seq if reg.durable else None
            handler, call = self._resolve(msg, msg_id, now)
            self.who = (call.session.num if call.session is not None else -1, msg_id, msg["op"])
            if envelope is not None and msg["op"] == "check" and self.checks.forks():
                self.checks.add(Waiter(envelope, msg_id, inc, state, pending_seq(reg, seq)))
                return None
            body = handler(self.handlers, call)
            return Answer(envelope, msg_id, inc, state, pending_seq(reg, seq), body)
        except ManagerError as e:
            self.stats.errors[e.code] += 1
            return Answer(envelope, msg_id, inc, state, pending_seq(reg, seq), error=e)
        except Exception:
            logger.exception("internal error handling a message")
            self.stats.errors["internal"] += 1
            return Answer(envelope, msg_id, inc, state, pending_seq(reg, seq),
                          error=ManagerError("internal", "manager error; see its log"))

    def _resolve(self, msg: dict, msg_id: int, now: float) -> tuple[Callable[[Handlers, Call], dict], Call]:
        v = msg.get("v")
        if type(v) is not int or v not in SUPPORTED_VERSIONS:
            raise ManagerError("unsupported_version", f"version {short_repr(v, 20)} unsupported; manager speaks "
                               f"{list(SUPPORTED_VERSIONS)}", {"versions": list(SUPPORTED_VERSIONS)})
        op = msg.get("op")
        spec = OPS.get(op) if type(op) is str else None
        if spec is None:
            # the admin ops are left to PROTOCOL.md: with every op the message outgrew its bound (300)
            known = ", ".join(sorted(name for name, s in OPS.items() if not s.admin))
            raise ManagerError("unknown_op", f"unknown op {short_repr(op, 40)}; known: {known}, and the admin "
                               "ops of PROTOCOL.md section 5")
        args = msg.get("args", {})
        if type(args) is not dict:
            raise ManagerError("bad_message", f"field 'args' must be a map, got {type(args).__name__}")
        sess: Session | None = None
        if spec.needs_session:
            sid = msg.get("sid")
            sess = self.registry.sessions.get(sid) if type(sid) is str else None
            if sess is None:
                raise ManagerError("unknown_session", "no such session (expired, ended, or the manager "
                                   "restarted): hello again; requests of the old session are gone")
            sess.seen(now)
            self.recovery.check_seen(msg.get("seq"))
            if spec.admin and not sess.admin:
                raise ManagerError("forbidden", f"op {op!r} is an admin op: hello with role 'admin' and the admin key"
                                   + (" (with CURVE on, the manager needs admin_key set for admin ops)"
                                      if self.admin_key_missing else ""))
        self.stats.ops[op] += 1
        return spec.handler, Call(msg_id, sess, args, now)


def pending_seq(reg: Registry, seq: int | None) -> int | None:
    """The commit sequence a reply carries: the batch this iteration commits when it mutated
    (the reply goes out only after that commit, or its queueing under async)."""
    return None if seq is None else seq + (1 if reg.log else 0)
