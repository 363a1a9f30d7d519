"""The Redis state store: a write-ahead journal of registry mutations plus periodic snapshots.

Keys of one namespace share the hash tag ``{NAMESPACE}`` (one Cluster slot), so every write is
one Lua script call, atomic on standalone, Sentinel and Cluster alike::

    kvpool:{NS}:snap     the latest state snapshot (manager/store/state_file.py), including batch ``seq``
    kvpool:{NS}:journal  list of journal batches (manager/store/journal.py) after the snapshot, in order
    kvpool:{NS}:seq      the seq of the last committed batch
    kvpool:{NS}:lease    the active manager's owner id, with a TTL (PX lease_ms)
    kvpool:{NS}:fence    the fencing token: INCR'd by every manager taking the lease
    kvpool:{NS}:clean    the seq a manager stopped cleanly at (nothing acknowledged past it)

Commit (``--durability sync``): the loop's records of one iteration become one batch, appended
by one script that first checks the fencing token (a manager that lost its lease can never
write), then the batch seq (a retried commit is recognised, a hole refused), renews the lease
and RPUSHes. The loop sends no reply of the iteration before the script returned.
``--durability async`` hands the batch to a writer thread (manager/store/redis_async.py) and replies
at once: a crash loses the batches not yet written, at most ``ASYNC_MAX_PENDING`` iterations
(typically the one or two of the last Redis round trip), and those clients were acknowledged.
Every reply carries the commit sequence; a state that lacks acknowledged batches is never served
as itself (manager/store/high_water.py decides; ``load`` then serves a new, empty state).

Compaction (manager/store/compaction.py): when the journal outgrows ``snapshot_bytes`` (and the
last snapshot), the loop forks a child that dumps the registry as it was and writes it
(manager/store/snapshot_child.py: the loop pauses only for the fork); one script sets the
snapshot and trims exactly the batches it includes, however many were appended meanwhile, so a
half-compacted state can never be loaded. Loading reads snapshot, journal and seq in one script,
replays the journal (manager/store/journal.py), checks that it ends at ``seq`` and that every
invariant holds, or raises ``CorruptState``: nothing is ever half-loaded.

This module owns the store's lifecycle and its commit sequence: lease, load, the loop's commit,
the clean stop. Every Redis call goes through manager/store/redis_link.py (scripts, fencing
token, WAIT for replicas).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.store.base import Fenced, StoreUnavailable
from kvpool.manager.store.compaction import Compaction
from kvpool.manager.store.high_water import HighWater, Mark, start_over_reason
from kvpool.manager.store.journal import encode_batch, recover
from kvpool.manager.store.lease import renewing
from kvpool.manager.store.redis_async import ASYNC_MAX_PENDING, AsyncWriter
from kvpool.manager.store.redis_link import RedisLink
from kvpool.manager.store.redis_scripts import namespace_keys
from kvpool.manager.store.view import StateView

logger = logging.getLogger(__name__)
DURABILITY = ("sync", "async")
__all__ = ["ASYNC_MAX_PENDING", "RedisStore", "namespace_keys"]


class RedisStore:
    """One namespace's state: its lease, load, the loop's commits, the clean stop.

    The Redis calls are ``link``'s (manager/store/redis_link.py), the snapshots ``compaction``'s
    (manager/store/compaction.py); the store owns the commit sequence and what was acknowledged.
    """

    durable = True

    def __init__(self, client, namespace: str, *, owner: str, durability: str = "sync",
                 lease_ms: int = 3000, snapshot_bytes: int = 32 << 20, high_water_path: str | None = None,
                 reconnect: Callable[[], Any] | None = None, min_replicas: int = 0) -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self.namespace, self.durability = namespace, durability
        # min_replicas: replicas that must confirm each commit (WAIT) before it is acknowledged
        self.link = RedisLink(client, namespace, owner=owner, lease_ms=lease_ms, min_replicas=min_replicas)
        self.compaction = Compaction(self.link, self._write_snapshot, namespace=namespace,
                                     snapshot_bytes=snapshot_bytes, reconnect=reconnect)
        self.seq = 0
        self.commits = self.start_overs = 0
        self.high_water = HighWater(high_water_path)
        self._acked: Mark | None = None
        self._writer: AsyncWriter | None = None

    @property
    def snap_seq(self) -> int:
        """The batch the snapshot in Redis includes (the journal holds the ones after it)."""
        return self.compaction.snap_seq

    @property
    def counts(self) -> dict[str, int]:
        c = self.compaction
        return {"commits": self.commits, "snapshots": c.snapshots, "failures": self.link.failures,
                "start_overs": self.start_overs, "snapshot_failures": c.failures}

    def acquire(self) -> bool:
        return self.link.acquire()

    # -- loading ---------------------------------------------------------------------------

    def load(self, reg: StateView, now: float) -> bool:
        """Fills the empty ``reg`` from Redis (call ``acquire`` first); False for a new namespace.

        The lease is renewed in small steps while a large state loads (a thread), so a manager
        that dies mid-load holds it for at most ``lease_ms``. A state older than one this
        manager acknowledged (high_water.py) is replaced by a new, empty one with a new state id.
        """
        self._stop_writer()
        self.compaction.abandon()
        t0 = time.perf_counter()
        with self._lease_kept():
            snap, blobs, seq, clean = self.link.read()
            if not snap:
                if blobs or seq:
                    raise CorruptState(f"namespace {self.namespace!r}: a journal without a snapshot (partial state)")
                reg.rename(uuid.uuid4().hex)
                self.seq = 0
                self.compaction.now(reg, self.seq)
                loaded = False
            else:
                snap_seq, self.seq = recover(reg, snap, blobs, int(seq or -1), f"namespace {self.namespace!r}", now)
                self.compaction.loaded(snap_seq, len(snap), sum(map(len, blobs)))
                why = start_over_reason(reg.state_id, self.seq, [self._acked, self.high_water.read()],
                                        int(clean) if clean else None, self.durability)
                if why is not None:
                    self._start_over(reg, why)
                loaded = True
            if self.link.min_replicas:  # what is served now must be on the replicas too (a write, then WAIT)
                self.link.confirm_replicas()
        reg.mark_durable()
        reg.mark_committed(self.seq)
        self._ack(reg)
        if self.durability == "async":
            self._writer = AsyncWriter(self.link.write_blobs, self.link.write_snapshot)
        logger.info("namespace %s: %s state %s at batch %d (%d journal batches replayed) in %.2fs",
                    self.namespace, "recovered" if loaded else "created", reg.state_id, self.seq,
                    self.seq - self.snap_seq, time.perf_counter() - t0)
        return loaded

    def _start_over(self, reg: StateView, why: str) -> None:
        """Serves a new empty state instead of one that went back in time: every client's next
        call sees another state id (ManagerRestarted: abort, register again, recompute)."""
        old = reg.state_id
        reg.start_over(uuid.uuid4().hex)
        logger.error("namespace %s: %s; serving a new empty state %s instead of %s (clients are told: they abort, "
                     "register again and recompute)", self.namespace, why, reg.state_id, old)
        self.start_overs += 1
        self.compaction.now(reg, self.seq)

    def _ack(self, reg: StateView) -> None:
        """``reg``'s state at ``self.seq`` is what replies from now on say (before they go out)."""
        self._acked = Mark(reg.state_id, self.seq)
        self.high_water.note(reg.state_id, self.seq)

    def saw(self, state_id: str, seq: int) -> None:
        if self._acked is None or self._acked.state_id != state_id or self._acked.seq < seq:
            self._acked = Mark(state_id, seq)

    def _lease_kept(self):
        """Renews the lease every ``lease_ms / 3`` from a thread while the body runs."""
        lease_ms = self.link.lease_ms
        return renewing(lambda: self.link.renew(lease_ms), lease_ms / 3000, f"namespace {self.namespace}")

    # -- the loop's commit -----------------------------------------------------------------

    def commit(self, reg: StateView, dirty: set[str]) -> None:
        if self._writer is not None and self._writer.error is not None:
            raise self._writer.error  # an async write failed: stop acknowledging now
        log = reg.take_log()
        if log:
            self.seq += 1
            blob = encode_batch(self.seq, log)
            self.compaction.appended(len(blob))
            if self._writer is not None:
                self._writer.put(("blobs", self.seq, [blob]))
            else:
                self.link.write_blobs(self.seq, [blob])
            self.commits += 1
            reg.mark_committed(self.seq)
            self._ack(reg)
            if self.compaction.due():
                self.compaction.in_background(reg, self.seq)
        elif self.link.renewal_due():  # an idle iteration still renews the lease
            if self._writer is not None:
                self._writer.put(("renew",))
            else:
                self.link.write_blobs(self.seq + 1, [])
            self.link.renewed()
        self.compaction.poll()

    def compact(self, reg: StateView) -> None:
        """Snapshot now, on this thread, dropping the journal batches it includes."""
        self.compaction.now(reg, self.seq)

    def wait_for_snapshot(self) -> None:
        """Blocks until a background snapshot (if one is running) is written and counted."""
        self.compaction.wait()

    def _write_snapshot(self, data: bytes, seq: int) -> None:
        """A snapshot from the loop: after the batches queued before it (async), or now."""
        if self._writer is not None:
            self._writer.put(("snapshot", data, seq))
        else:
            self.link.write_snapshot(data, seq)

    # -- the rest ----------------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.compaction
        return {"kind": "redis", "namespace": self.namespace, "durability": self.durability, "seq": self.seq,
                "snapshot_seq": c.snap_seq, "journal_bytes": c.journal_bytes,
                "snapshot_bytes": c.snap_bytes, "fencing_token": self.link.token, **self.counts}

    def _stop_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def shutdown(self, reg: StateView | None) -> None:
        """A clean stop: flush, snapshot ``reg`` (None: it is not ours to write), release the lease."""
        try:
            if self._writer is not None:
                self._writer.flush()
                failed = self._writer.error is not None
                self._stop_writer()
                if failed:
                    return
            if reg is not None and self.link.token is not None and self.seq > self.snap_seq:
                self.compact(reg)
            if self.link.token is not None:
                self.link.release(self.seq)
        except (StoreUnavailable, Fenced) as e:
            logger.warning("namespace %s: no final snapshot (%s); the journal has every commit", self.namespace, e)

    def close(self) -> None:
        self._stop_writer()
        self.compaction.abandon()
        self.high_water.close()
        self.link.close()
