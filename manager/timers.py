"""The loop's timed chores: expiring silent sessions and lapsed pins, and its own collections.

Sessions expire in the loop's monotonic time: one silent for ``session_timeout`` is dead and its
requests are freed (checked every ``session_timeout / 4``, at most every second, and at once
after the state was (re)loaded). Pins live in wall-clock time (their TTLs survive a restart).

The state is acyclic and large (per-block lists, the hash map): Python's automatic collections
would traverse all of it every few thousand allocations. The loop turns them off and collects
in an idle iteration instead, at most every ``GC_EVERY_S`` (10x that if never idle).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.manager.registry import Registry
from kvpool.manager.stats import ServerStats

logger = logging.getLogger(__name__)
GC_EVERY_S = 30.0  # cyclic garbage is collected in an idle iteration at most this often


class LoopTimers:
    """When the next expiry check and the next collection are due; runs them."""

    def __init__(self, registry: Registry, stats: ServerStats, *, session_timeout_s: float) -> None:
        self.registry, self.stats = registry, stats
        self._expiry_every = min(session_timeout_s / 4, 1.0)
        self._next_expiry = 0.0
        self._next_gc = 0.0

    def expiry_due(self, now: float) -> bool:
        return now >= self._next_expiry

    def expire_soon(self) -> None:
        """Check expiry at the next iteration (a state just loaded: its clocks start now)."""
        self._next_expiry = 0.0

    def expire(self, now: float) -> None:
        self._next_expiry = now + self._expiry_every
        for sess, freed in self.registry.expire(now):
            self.stats.sessions_expired += 1
            self.stats.expired_requests_freed += freed
            logger.warning("session %d (%s) silent for %.1fs: expired, %d requests freed",
                           sess.num, sess.identity, now - sess.last_seen, freed)
        if self.registry.pins.pins:
            for pin_id in self.registry.expire_pins(time.time()):  # pins live in wall-clock time
                logger.info("pin %d expired", pin_id)

    @contextmanager
    def collecting_when_idle(self) -> Iterator[None]:
        """Automatic collections off while the body (the loop) runs; ``maybe_gc`` collects instead."""
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def maybe_gc(self, idle: bool) -> None:
        """A full collection in an idle iteration, at most every GC_EVERY_S (10x that if never idle)."""
        now = time.monotonic()
        if now >= self._next_gc and (idle or now >= self._next_gc + 9 * GC_EVERY_S):
            t0 = time.perf_counter()
            gc.collect()
            self.stats.observe_gc(time.perf_counter() - t0)
            self._next_gc = now + GC_EVERY_S
