"""Compaction of the Redis store: when the journal is folded into a snapshot, and who writes it.

The journal grows by every commit; once it outgrows ``snapshot_bytes`` (and the last snapshot)
the state is snapshotted and the batches it includes are trimmed, by one script
(manager/store/redis_scripts.py ``SNAPSHOT``). The loop forks a child that dumps the registry as
it was and writes it (manager/store/snapshot_child.py: the loop pauses only for the fork); the
snapshot counts as taken once the loop reaps the child. Without a way to reconnect (or to fork)
the snapshot is written on the loop. One child at a time; a failed one loses nothing (the
journal still holds every batch) and the next commit tries again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvpool.manager.store.redis_link import RedisLink
from kvpool.manager.store.redis_scripts import SNAPSHOT
from kvpool.manager.store.snapshot_child import (
    Child,
    fork_snapshot,
    kill,
    reap,
    write_when_journal_ready,
)
from kvpool.manager.store.state_file import dump_registry, encode_state
from kvpool.manager.store.view import StateView

logger = logging.getLogger(__name__)


class Compaction:
    """The snapshot's and the journal's sizes, the background child, the snapshot counters.

    ``write(data, seq)`` is how the store writes a snapshot from the loop (through its async
    writer, if any, so it lands after the batches queued before it).
    """

    def __init__(self, link: RedisLink, write: Callable[[bytes, int], None], *, namespace: str,
                 snapshot_bytes: int, reconnect: Callable[[], Any] | None) -> None:
        self.link, self._write, self.namespace, self.snapshot_bytes = link, write, namespace, snapshot_bytes
        self._reconnect = reconnect  # a fresh client, for a forked snapshot child (None: snapshot on the loop)
        self.snap_seq = 0
        self.journal_bytes = self.snap_bytes = 0
        self.snapshots = self.failures = 0
        self._child: Child | None = None
        self._child_bytes = 0

    def loaded(self, snap_seq: int, snap_bytes: int, journal_bytes: int) -> None:
        """What a load found in Redis: the snapshot at ``snap_seq`` and the journal after it."""
        self.snap_seq, self.snap_bytes, self.journal_bytes = snap_seq, snap_bytes, journal_bytes

    def appended(self, batch_bytes: int) -> None:
        self.journal_bytes += batch_bytes

    def due(self) -> bool:
        """The journal outgrew the snapshot limit and no child is writing one already."""
        return self.journal_bytes >= max(self.snapshot_bytes, self.snap_bytes) and self._child is None

    def now(self, reg: StateView, seq: int) -> None:
        """Snapshot ``reg`` at batch ``seq`` on this thread, dropping the batches it includes."""
        self.wait()
        data = encode_state(dump_registry(reg, seq))
        self._write(data, seq)
        self.snap_seq, self.snap_bytes, self.journal_bytes = seq, len(data), 0
        self.snapshots += 1

    def in_background(self, reg: StateView, seq: int) -> None:
        """A forked child writes the snapshot (snapshot_child.py); the loop carries on."""
        if self._reconnect is None:
            self.now(reg, seq)
            return
        token = self.link.token
        child = fork_snapshot(lambda: encode_state(dump_registry(reg, seq)),
                              lambda data: self._child_write(data, seq, token), seq)
        if child is None:
            self.now(reg, seq)
            return
        self._child = child
        self._child_bytes, self.journal_bytes = self.journal_bytes, 0

    def poll(self) -> None:
        """Counts a background snapshot whose child exited (each iteration)."""
        if self._child is not None:
            self._reap()

    def wait(self) -> None:
        """Blocks until a background snapshot (if one is running) is written and counted."""
        if self._child is not None:
            self._reap(block=True)

    def abandon(self) -> None:
        """Kills a child whose snapshot is no longer wanted (the state is being reloaded)."""
        if self._child is not None:
            kill(self._child)
            self._child = None

    def _child_write(self, data: bytes, seq: int, token: str | None) -> None:
        """In the child: its own connection; waits while the journal is behind ``seq``."""
        keys, args = self.link.snapshot_call(data, seq, token)
        write_when_journal_ready(self._reconnect(), SNAPSHOT, keys, args)  # type: ignore[misc]

    def _reap(self, block: bool = False) -> None:
        out = reap(self._child, block)  # type: ignore[arg-type]
        if out is None:
            return
        self._child = None
        if out.ok:
            self.snap_seq, self.snap_bytes = out.seq, out.size
            self.snapshots += 1
        else:  # the journal still holds every batch: the next commit tries again
            logger.warning("namespace %s: background snapshot at batch %d failed: %s", self.namespace, out.seq, out.why)
            self.failures += 1
            self.journal_bytes += self._child_bytes
