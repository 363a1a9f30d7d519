"""The generate protocol's client side without I/O: what the sync ``GenerateClient``
(client/generate.py) and the asyncio ``WorkerLink`` (client/generate_async.py) share.

``GenerateCore`` numbers requests and builds their messages (shared/generate.py's records);
``Stream`` reads one request's replies: which samples are still open, a refusal (ValueError),
and what a heartbeat's ``waiting`` means for the caller (``WorkerUnavailable``). ``Outage``
holds off "the manager cannot be reached" for a grace: one call that timed out on a loaded
machine is not an outage (the front door keeps one per request and one per manager it polls).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

from kvpool.shared.generate import (
    Control,
    ErrorMessage,
    GenerateRequest,
    Heartbeat,
    Reply,
    TokenMessage,
    pack,
)
from kvpool.shared.sampling import SamplingParams

MANAGER_GRACE_S = 5.0  # how long a manager must stay unreachable before requests give up on it


class Outage:
    """How long something has been reported down, and whether that is past ``grace_s``."""

    __slots__ = ("grace_s", "since")

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.since: float | None = None  # time.monotonic() of the first report since it was last up

    def down(self, now: float) -> float | None:
        """Reported down at ``now``: the seconds it has been down once past the grace, else None."""
        if self.since is None:
            self.since = now
        lasted = now - self.since
        return lasted if lasted >= self.grace_s else None

    def up(self) -> None:
        self.since = None


class WorkerUnavailable(RuntimeError):
    """The worker cannot serve a request; ``cause`` says why (client/generate.py's docstring)."""

    def __init__(self, message: str, cause: str = "timeout") -> None:
        super().__init__(message)
        self.cause = cause


class WorkerLost(RuntimeError):
    """The worker serving a request went away (killed, disconnected, silent too long)."""


class GenerateCore:
    """Request ids (``PREFIX-N``, or the op's name as prefix) and the messages' bytes."""

    def __init__(self, prefix: str | None = None) -> None:
        self._prefix = prefix
        self._ids = itertools.count()

    def next_id(self, op: str) -> str:
        return f"{self._prefix or op}-{next(self._ids)}"

    def generate(self, prompt: list[int], params: SamplingParams | Mapping[str, Any],
                 cache_salt: str | None = None) -> tuple[str, bytes]:
        """(its id, the message) of a generate request."""
        req = GenerateRequest(self.next_id("generate"), prompt, params, cache_salt)
        return req.client_id, pack(req.to_wire())

    def control(self, op: str, rid: str | None = None) -> tuple[str, bytes]:
        """(its id, the message) of an abort (of ``rid``), stats or ping."""
        ctl = Control(op, rid if rid is not None else self.next_id(op))
        return ctl.client_id, pack(ctl.to_wire())


class Stream:
    """One request's replies as the caller sees them: tokens until every sample finished."""

    def __init__(self, rid: str, n: int, manager_grace_s: float) -> None:
        self.rid = rid
        self.open_samples = set(range(max(1, n)))  # n < 1: wait for the refusal
        self.manager = Outage(manager_grace_s)  # the worker's "manager unreachable" heartbeats

    @property
    def done(self) -> bool:
        return not self.open_samples

    def feed(self, reply: Reply | None) -> TokenMessage | None:
        """The token message to hand on (None: not one of ours, or a heartbeat); raises
        ValueError (refused) or WorkerUnavailable (the request cannot move)."""
        if reply is None or reply.client_id != self.rid:
            return None
        if isinstance(reply, ErrorMessage):
            self.open_samples.clear()
            raise ValueError(f"the worker refused the request: {reply.error}")
        if isinstance(reply, Heartbeat):
            self._check_waiting(reply.waiting)
            return None
        if not isinstance(reply, TokenMessage):
            return None
        self.manager.up()
        if reply.finished:
            self.open_samples.discard(reply.index)
        return reply

    def _check_waiting(self, reason: object) -> None:
        """Raises when a heartbeat says the request cannot move; notes when the manager was
        first reported unreachable."""
        if reason == "draining":
            raise WorkerUnavailable("the manager is draining: it admits no new requests (an operator ran "
                                    "`kvpool drain`; `kvpool drain --cancel` ends it); retry later", "draining")
        if reason != "manager_unreachable":
            self.manager.up()
            return
        lasted = self.manager.down(time.monotonic())
        if lasted is not None:
            raise WorkerUnavailable(f"the worker cannot reach its manager (for {lasted:.0f}s); "
                                    "check `kvpool status` on the worker's host", "manager_unreachable")
