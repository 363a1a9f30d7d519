"""Group commit: what the loop does between handling an iteration's messages and replying.

Once per iteration, in this order (manager/store/base.py): the store commits the iteration's
mutations (every iteration, dirty or not: an idle one renews the lease), the pools' KV events go
to the publisher, and only then are the iteration's answers encoded, now that the commit's
outcome is known, together with the replies of forked checks that finished (manager/check_job.py).
A failed commit, or a client that saw commits this state lacks, acknowledges nothing: every
answer of the iteration becomes the recovery's error (manager/store/recovery.py), and the events
of the uncommitted mutations are never published.
"""

from __future__ import annotations

import time

from kvpool.manager.check_job import CheckJobs
from kvpool.manager.ops import Answer
from kvpool.manager.registry import Registry
from kvpool.manager.stats import ServerStats
from kvpool.manager.store.base import EventSink, Fenced, StateStore, StoreUnavailable
from kvpool.manager.store.recovery import Recovery


class GroupCommit:
    """Commits, publishes and encodes one iteration; owns the event sink the events go to."""

    def __init__(self, registry: Registry, store: StateStore, recovery: Recovery, checks: CheckJobs,
                 stats: ServerStats, publisher: EventSink) -> None:
        self.registry, self.store, self.recovery, self.checks = registry, store, recovery, checks
        self.stats, self.publisher = stats, publisher

    def publish_to(self, publisher: EventSink) -> None:
        """The sink the events go to from now on (the loop's sockets, once bound)."""
        self.publisher = publisher

    def commit(self, answers: list[Answer | None] | None = None) -> list[list[bytes]]:
        """Store commit, then KV events: both before any reply of this iteration goes out; then
        the iteration's answers encoded, now that the commit's outcome is known.

        The store is called every iteration (it renews its lease when idle). A failed commit
        acknowledges nothing: the iteration's answers become errors (manager/store/recovery.py).
        """
        reg = self.registry
        if self.recovery.went_back is not None:  # a client saw commits this state lacks: acknowledge nothing
            return self._failed(StoreUnavailable(self.recovery.went_back), answers or [])
        t0 = time.perf_counter()
        dirty = reg.take_dirty()
        try:
            self.store.commit(reg, dirty)
        except (StoreUnavailable, Fenced) as e:
            return self._failed(e, answers or [])
        if dirty:
            self.stats.commit_latency.observe(time.perf_counter() - t0)
        self._publish()
        replies = [answer.frames() for answer in answers or () if answer is not None]
        return replies + self.checks.poll()  # forked checks that finished (they mutate nothing)

    def _publish(self) -> None:
        """The committed iteration's KV events: orphaned pools', each pool's, the node tiers'."""
        reg = self.registry
        batches = reg.take_orphan_events()
        for name, entry in reg.pools.items():
            events = entry.pool.take_events() if entry.pool is not None else []
            if events:
                batches.append((name, entry.epoch, events))
        batches += [(topic, 0, events) for topic, events in reg.take_node_events()]
        for name, epoch, events in batches:
            self.publisher.publish(name, epoch, events)
            self.stats.event_batches += 1
            self.stats.events += len(events)

    def _failed(self, err: Exception, answers: list[Answer | None]) -> list[list[bytes]]:
        """The commit failed: every answer of the iteration becomes the recovery's error."""
        pending = [answer for answer in answers if answer is not None]
        failure = self.recovery.lost_store(err, len(pending))
        return [answer.failed(failure).frames() for answer in pending]
