"""How the loop loses and regains its state store: failed commits, recovery, standby, fencing.

The loop (manager/server.py) owns a ``Recovery`` and is *active* while it holds the store's lease and its state is the
store's. Otherwise it keeps answering, with an error and no state change:

- ``recovering``: a commit failed (Redis down or unreachable). The iteration's mutations may or
  may not have reached Redis, so the in-memory state is no longer trusted: every reply of that
  iteration becomes ``store_unavailable`` (nothing acknowledged), and every ``RECOVER_EVERY_S``
  the loop takes the lease again and reloads the whole state from Redis, then serves. A step
  that did commit is answered from the session's reply cache when the client retries it.
- ``standby``: another manager holds the lease; ``not_active`` tells clients to try their next
  endpoint. Every ``lease_ms / 5`` the loop tries to take the lease (it is free once the active
  one stops renewing it), then loads the state and serves.
- a client's request says it saw a commit this state lacks (``check_seen``): as a failed
  commit; the reload then serves a new state id, since the store went back in time.
- ``fenced``: a commit found another manager's fencing token (this one was paused or cut off
  past its lease and a standby took over): replies become ``not_active`` and the process exits
  with ``EXIT_FENCED``; systemd restarts it, as a standby.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

from kvpool.manager.store.base import Fenced, StateStore, StoreUnavailable
from kvpool.shared.protocol import ManagerError

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Callable

    from kvpool.manager.store.view import StateView

logger = logging.getLogger(__name__)
RECOVER_EVERY_S = 0.5
EXIT_FENCED = 75  # EX_TEMPFAIL: another manager took the lease
INACTIVE = {
    "starting": ("store_unavailable", "the manager is loading its state: retry shortly"),
    "recovering": ("store_unavailable", "the state store (Redis) is unreachable: nothing is acknowledged until "
                   "it is back; retry (a step with the same id)"),
    "standby": ("not_active", "this manager is a standby (another one holds the lease): try the next endpoint"),
    "fenced": ("not_active", "this manager lost its lease to another one and is stopping: try the next endpoint"),
}


class Recovery:
    """The server's standing with its store: the mode, and the moves between modes.

    The server owns one and hands it what it touches: the store, the registry the loop serves
    (the one object the handlers and metrics hold: a recovered state is adopted into it),
    a factory for an empty registry, the error counter and a way to stop the loop.
    """

    def __init__(self, store: StateStore, registry: StateView, *, lease_ms: int,
                 new_registry: Callable[[str], StateView], errors: Counter, request_stop: Callable[[], None]) -> None:
        self.store, self.registry, self.lease_ms = store, registry, lease_ms
        self.new_registry, self.errors, self.request_stop = new_registry, errors, request_stop
        # "active" serves; "recovering" (the store failed), "standby" (no lease) and "fenced"
        # (lost the lease) answer every message with an INACTIVE error and change nothing.
        self.mode = "active" if not store.durable else "starting"
        self.exit_code = 0
        self.next_activate = 0.0
        self.went_back: str | None = None  # why the state must be reloaded (check_seen)
        self.served = False  # it was active once: only then can another manager cut it off

    def activate(self, now: float) -> bool:
        """Takes the lease and loads the state into a fresh registry, which the server's adopts
        only once it is whole; True when the loop serves again. CorruptState propagates (the
        manager refuses to serve)."""
        was = self.mode
        self.next_activate = now + (self.lease_ms / 5000 if was == "standby" else RECOVER_EVERY_S)
        try:
            if not self.store.acquire():
                # cut off past the lease, and a standby took over; one that never served (a
                # standby or a starting manager whose poll timed out) just stands by
                if was == "recovering" and self.served:
                    self._fence("the lease went to another manager while the store was unreachable")
                elif was != "standby":
                    logger.warning("another manager holds the lease: standing by")
                self.mode = "standby"
                return False
            fresh = self.new_registry(self.registry.incarnation)
            self.store.load(fresh, now)
        except StoreUnavailable as e:
            if was != "recovering":
                logger.error("state store unavailable: %s; answering store_unavailable until it is back", e)
            self.mode = "recovering"
            return False
        except Fenced as e:
            self._fence(str(e))
            return False
        fresh.start_clocks(time.monotonic())  # a load of millions of blocks takes seconds
        self.registry.adopt(fresh)
        self.mode, self.went_back, self.served = "active", None, True
        logger.warning("manager %s active: state %s, %d sessions, %d pools, %d requests", self.registry.incarnation,
                       fresh.state_id, len(fresh.sessions), len(fresh.pools), fresh.total_requests())
        return True

    def check_seen(self, seen: object) -> None:
        """A request says its client saw commit ``seen`` of this state; beyond the last commit, the
        store went back in time under this manager (Redis restored, a lagging replica promoted):
        nothing more is acknowledged, and the reload serves a new state (high_water.py)."""
        reg = self.registry
        if type(seen) is not int or seen <= reg.seq or not reg.durable:
            return
        self.went_back = f"a client saw commit {seen} of state {reg.state_id}, which ends at {reg.seq}"
        self.store.saw(reg.state_id, seen)
        raise ManagerError(*INACTIVE["recovering"])

    def lost_store(self, err: Exception, pending: int) -> ManagerError:
        """A commit failed: nothing of this iteration is acknowledged; stop serving until
        recovered. Returns the error each of the iteration's ``pending`` replies becomes."""
        self.registry.discard_uncommitted()  # events of uncommitted mutations are never published
        if isinstance(err, Fenced):
            self._fence(str(err))
        else:
            logger.error("commit failed (%s): this iteration's %d replies become store_unavailable; "
                         "recovering from the store", err, pending)
            self.mode = "recovering"
            self.next_activate = 0.0
        failure = ManagerError(*INACTIVE[self.mode])
        self.errors[failure.code] += pending
        return failure

    def _fence(self, why: str) -> None:
        logger.error("fenced: %s; this manager stops (exit %d) and must not write again", why, EXIT_FENCED)
        self.mode = "fenced"
        self.exit_code = EXIT_FENCED
        self.request_stop()


def settle_heap() -> int:
    """Moves the state just loaded out of the garbage collector's sight (``gc.freeze``): the
    loop's idle collections then traverse only what changed since, never a 1M-block state.
    Returns how many objects are frozen (counted here, once: the count walks them all)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
