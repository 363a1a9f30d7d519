"""The manager loop's records: an op's spec, the call a handler gets, the answer it leaves.

- ``OpSpec``: what the loop needs to know of an op before running it (its handler, whether it
  needs a session, whether it is an admin op). ``op`` registers one in ``OPS`` where the handler
  is defined (manager/handlers.py): the one dispatch table.
- ``Call``: one request, as its handler receives it (message id, session, args, the loop's
  clock): parameters passed, never set as fields on the handlers.
- ``Answer``: a handled request's outcome, encoded once (``encode``) when the iteration's commit
  outcome is known; a failed commit turns each one into an error first (``failed``). Its bytes
  are ``ok_reply``/``error_reply``'s (shared/PROTOCOL.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvpool.manager.state.entries import Session
from kvpool.shared.protocol import ManagerError, error_reply, ok_reply


class OpSpec(NamedTuple):
    handler: Callable[[Any, Call], dict]  # an unbound method of Handlers
    needs_session: bool
    admin: bool


OPS: dict[str, OpSpec] = {}  # op name -> spec, filled by @op as manager/handlers.py is imported


def op(*, session: bool = True, admin: bool = False) -> Callable[[Callable[[Any, Call], dict]],
                                                                 Callable[[Any, Call], dict]]:
    """Registers the decorated handler method under its own name as an op."""
    def register(handler: Callable[[Any, Call], dict]) -> Callable[[Any, Call], dict]:
        if handler.__name__ in OPS:
            raise ValueError(f"op {handler.__name__!r} is registered twice")
        OPS[handler.__name__] = OpSpec(handler, session, admin)
        return handler
    return register


@dataclass(slots=True)  # not frozen: a frozen init costs 0.5 us, on every message
class Call:
    msg_id: int
    session: Session | None  # None only for an op without a session (hello)
    args: dict
    now: float

    @property
    def sess(self) -> Session:
        """The caller's session, for an op that needs one (the loop resolved it)."""
        if self.session is None:
            raise RuntimeError("this op runs without a session")
        return self.session


@dataclass(slots=True)
class Answer:
    """``body`` for an ok reply, else ``error``; ``state``/``seq`` as the reply will carry them
    (the pending commit sequence is taken when the request was handled)."""

    envelope: tuple[bytes, ...] | None
    msg_id: int | None
    inc: str
    state: str | None
    seq: int | None
    body: dict | None = None
    error: ManagerError | None = None

    def encode(self) -> bytes:
        if self.error is None:
            return ok_reply(self.msg_id, self.inc, self.body or {}, self.state, self.seq)
        return error_reply(self.msg_id, self.inc, self.error, self.state, self.seq)

    def frames(self) -> list[bytes]:
        return [*(self.envelope or ()), self.encode()]

    def failed(self, err: ManagerError) -> Answer:
        """The same request answered with ``err`` instead (nothing of its iteration was
        committed): no commit sequence, since none is acknowledged."""
        return Answer(self.envelope, self.msg_id, self.inc, self.state, None, None, err)
