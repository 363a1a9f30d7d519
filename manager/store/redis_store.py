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

Compaction: when the journal outgrows ``snapshot_bytes`` (and the last snapshot), the loop forks
a child that dumps the registry as it was and writes it (manager/store/snapshot_child.py: the
loop pauses only for the fork); one script sets the snapshot and trims exactly the batches it
includes, however many were appended meanwhile, so a half-compacted state can never be loaded. Loading reads snapshot, journal and seq in one script,
replays the journal (manager/store/journal.py), checks that it ends at ``seq`` and that every
invariant holds, or raises ``CorruptState``: nothing is ever half-loaded.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.store.base import Fenced, StoreUnavailable
from kvpool.manager.store.high_water import HighWater, Mark, start_over_reason
from kvpool.manager.store.journal import encode_batch, recover
from kvpool.manager.store.lease import renewing
from kvpool.manager.store.redis_async import ASYNC_MAX_PENDING, AsyncWriter
from kvpool.manager.store.redis_scripts import (
    ACQUIRE,
    COMMIT,
    READ,
    RELEASE,
    SNAPSHOT,
    namespace_keys,
)
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
DURABILITY = ("sync", "async")
__all__ = ["ASYNC_MAX_PENDING", "RedisStore", "namespace_keys"]

def store_error(e: Exception) -> Exception:
    """A redis-py exception as Fenced or StoreUnavailable."""
    text = str(e)
    return Fenced(text) if text.startswith("FENCED") else StoreUnavailable(f"{type(e).__name__}: {text}")


class RedisStore:
    durable = True

    def __init__(self, client, namespace: str, *, owner: str, durability: str = "sync",
                 lease_ms: int = 3000, snapshot_bytes: int = 32 << 20, high_water_path: str | None = None,
                 reconnect: Callable[[], Any] | None = None, min_replicas: int = 0) -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self.r, self.namespace, self.owner = client, namespace, owner
        self.durability, self.lease_ms, self.snapshot_bytes = durability, lease_ms, snapshot_bytes
        self.keys = namespace_keys(namespace)
        self._scripts = {name: client.register_script(src) for name, src in
                         (("commit", COMMIT), ("snapshot", SNAPSHOT), ("acquire", ACQUIRE), ("read", READ),
                          ("release", RELEASE))}
        self.token: str | None = None
        self.seq = self.snap_seq = 0
        self.journal_bytes = self.snap_bytes = 0
        self.counts = {"commits": 0, "snapshots": 0, "failures": 0, "start_overs": 0, "snapshot_failures": 0}
        # Replicas that must confirm each commit (WAIT) before it is acknowledged: a Sentinel
        # failover then loses nothing acknowledged. The wait stays inside the socket timeout.
        self.min_replicas = min_replicas
        timeout = client.get_connection_kwargs().get("socket_timeout") if hasattr(client, "get_connection_kwargs") else None
        self.wait_ms = max(10, int(float(timeout or 2.0) * 500))
        self._reconnect = reconnect  # a fresh client, for a forked snapshot child (None: snapshot on the loop)
        self._child: Child | None = None
        self._child_bytes = 0
        self.high_water = HighWater(high_water_path)
        self._acked: Mark | None = None
        self._last_write = 0.0
        self._writer: AsyncWriter | None = None

    # -- the lease -------------------------------------------------------------------------

    def acquire(self) -> bool:
        k = self.keys
        token = self._run("acquire", [k["lease"], k["fence"]], [self.owner, self.lease_ms])
        if token is None:
            return False
        self.token = str(token)
        self._last_write = time.monotonic()
        return True

    # -- loading ---------------------------------------------------------------------------

    def load(self, reg: StateView, now: float) -> bool:
        """Fills the empty ``reg`` from Redis (call ``acquire`` first); False for a new namespace.

        The lease is renewed in small steps while a large state loads (a thread), so a manager
        that dies mid-load holds it for at most ``lease_ms``. A state older than one this
        manager acknowledged (high_water.py) is replaced by a new, empty one with a new state id.
        """
        self._stop_writer()
        self._abandon_child()
        t0 = time.perf_counter()
        with self._lease_kept():
            snap, blobs, seq, clean = self._run("read", self.read_keys(), [])
            if not snap:
                if blobs or seq:
                    raise CorruptState(f"namespace {self.namespace!r}: a journal without a snapshot (partial state)")
                reg.rename(uuid.uuid4().hex)
                self.seq = self.snap_seq = 0
                self._snapshot_now(reg)
                loaded = False
            else:
                self.snap_seq, self.seq = recover(reg, snap, blobs, int(seq or -1), f"namespace {self.namespace!r}", now)
                self.snap_bytes, self.journal_bytes = len(snap), sum(map(len, blobs))
                why = start_over_reason(reg.state_id, self.seq, [self._acked, self.high_water.read()],
                                        int(clean) if clean else None, self.durability)
                if why is not None:
                    self._start_over(reg, why)
                loaded = True
            if self.min_replicas:  # what is served now must be on the replicas too (a write, then WAIT)
                k = self.keys
                self._run_replicated("commit", [k["fence"], k["lease"], k["journal"], k["seq"]],
                                     [self.token, self.owner, self.lease_ms, 0])
        reg.mark_durable()
        reg.mark_committed(self.seq)
        self._ack(reg)
        if self.durability == "async":
            self._writer = AsyncWriter(self._write_blobs, self._write_snapshot)
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
        self.counts["start_overs"] += 1
        self._snapshot_now(reg)

    def _ack(self, reg: StateView) -> None:
        """``reg``'s state at ``self.seq`` is what replies from now on say (before they go out)."""
        self._acked = Mark(reg.state_id, self.seq)
        self.high_water.note(reg.state_id, self.seq)

    def saw(self, state_id: str, seq: int) -> None:
        if self._acked is None or self._acked.state_id != state_id or self._acked.seq < seq:
            self._acked = Mark(state_id, seq)

    def read_keys(self) -> list[str]:
        k = self.keys
        return [k["snap"], k["journal"], k["seq"], k["clean"]]

    def _lease_kept(self):
        """Renews the lease every ``lease_ms / 3`` from a thread while the body runs."""
        return renewing(lambda: self._renew(self.lease_ms), self.lease_ms / 3000, f"namespace {self.namespace}")

    # -- the loop's commit -----------------------------------------------------------------

    def commit(self, reg: StateView, dirty: set[str]) -> None:
        if self._writer is not None and self._writer.error is not None:
            raise self._writer.error  # an async write failed: stop acknowledging now
        log = reg.take_log()
        if log:
            self.seq += 1
            blob = encode_batch(self.seq, log)
            self.journal_bytes += len(blob)
            if self._writer is not None:
                self._writer.put(("blobs", self.seq, [blob]))
            else:
                self._write_blobs(self.seq, [blob])
            self.counts["commits"] += 1
            reg.mark_committed(self.seq)
            self._ack(reg)
            if self.journal_bytes >= max(self.snapshot_bytes, self.snap_bytes) and self._child is None:
                self._compact_in_background(reg)
        elif time.monotonic() - self._last_write >= self.lease_ms / 3000:
            if self._writer is not None:
                self._writer.put(("renew",))
            else:
                self._write_blobs(self.seq + 1, [])
            self._last_write = time.monotonic()
        if self._child is not None:
            self._reap_child()

    def compact(self, reg: StateView) -> None:
        """Snapshot now, on this thread, dropping the journal batches it includes."""
        self.wait_for_snapshot()
        self._snapshot_now(reg)

    def _snapshot_now(self, reg: StateView) -> None:
        data = encode_state(dump_registry(reg, self.seq))
        if self._writer is not None:
            self._writer.put(("snapshot", data, self.seq))
        else:
            self._write_snapshot(data, self.seq)
        self.snap_seq, self.snap_bytes, self.journal_bytes = self.seq, len(data), 0
        self.counts["snapshots"] += 1

    def _compact_in_background(self, reg: StateView) -> None:
        """A forked child writes the snapshot (snapshot_child.py); the loop carries on."""
        if self._reconnect is None:
            self.compact(reg)
            return
        seq, token = self.seq, self.token
        child = fork_snapshot(lambda: encode_state(dump_registry(reg, seq)),
                              lambda data: self._child_write(data, seq, token), seq)
        if child is None:
            self.compact(reg)
            return
        self._child = child
        self._child_bytes, self.journal_bytes = self.journal_bytes, 0

    def _child_write(self, data: bytes, seq: int, token: str | None) -> None:
        """In the child: its own connection; waits while the journal is behind ``seq``."""
        k = self.keys
        write_when_journal_ready(self._reconnect(), SNAPSHOT,  # type: ignore[misc]
                                 [k["fence"], k["lease"], k["snap"], k["journal"], k["seq"]],
                                 [token, self.owner, self.lease_ms, data, seq])

    def _reap_child(self, block: bool = False) -> None:
        out = reap(self._child, block)  # type: ignore[arg-type]
        if out is None:
            return
        self._child = None
        if out.ok:
            self.snap_seq, self.snap_bytes = out.seq, out.size
            self.counts["snapshots"] += 1
        else:  # the journal still holds every batch: the next commit tries again
            logger.warning("namespace %s: background snapshot at batch %d failed: %s", self.namespace, out.seq, out.why)
            self.counts["snapshot_failures"] += 1
            self.journal_bytes += self._child_bytes

    def wait_for_snapshot(self) -> None:
        """Blocks until a background snapshot (if one is running) is written and counted."""
        if self._child is not None:
            self._reap_child(block=True)

    def _abandon_child(self) -> None:
        if self._child is not None:
            kill(self._child)
            self._child = None

    # -- Redis calls (the loop's, or the async writer's thread) ------------------------------

    def _write_blobs(self, first_seq: int, blobs: list[bytes]) -> None:
        k = self.keys
        run = self._run_replicated if self.min_replicas and blobs else self._run
        run("commit", [k["fence"], k["lease"], k["journal"], k["seq"]],
            [self.token, self.owner, self.lease_ms, first_seq, *blobs])
        self._last_write = time.monotonic()

    def _run_replicated(self, name: str, keys: list[str], args: list):
        """The script, then WAIT for ``min_replicas`` in the same round trip; StoreUnavailable
        (nothing acknowledged) when fewer replicas confirm it in time."""
        import redis

        try:
            pipe = self.r.pipeline(transaction=False)
            self._scripts[name](keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.min_replicas, self.wait_ms)
            result, acked = pipe.execute()
        except redis.RedisError as e:
            self.counts["failures"] += 1
            raise store_error(e) from None
        if acked < self.min_replicas:
            self.counts["failures"] += 1
            raise StoreUnavailable(f"{acked} of {self.min_replicas} replicas (redis_min_replicas) confirmed the "
                                   f"commit within {self.wait_ms} ms")
        return result

    def _renew(self, lease_ms: int) -> None:
        k = self.keys
        self._run("commit", [k["fence"], k["lease"], k["journal"], k["seq"]], [self.token, self.owner, lease_ms, 0])
        self._last_write = time.monotonic()

    def _write_snapshot(self, data: bytes, seq: int) -> None:
        k = self.keys
        self._run("snapshot", [k["fence"], k["lease"], k["snap"], k["journal"], k["seq"]],
                  [self.token, self.owner, self.lease_ms, data, seq])

    def _run(self, name: str, keys: list[str], args: list):
        import redis

        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.RedisError as e:
            self.counts["failures"] += 1
            raise store_error(e) from None

    # -- the rest ----------------------------------------------------------------------------

    def stats(self) -> dict:
        return {"kind": "redis", "namespace": self.namespace, "durability": self.durability, "seq": self.seq,
                "snapshot_seq": self.snap_seq, "journal_bytes": self.journal_bytes,
                "snapshot_bytes": self.snap_bytes, "fencing_token": self.token, **self.counts}

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
            if reg is not None and self.token is not None and self.seq > self.snap_seq:
                self.compact(reg)
            if self.token is not None:
                self._run("release", [self.keys["lease"], self.keys["clean"]], [self.owner, self.seq])
        except (StoreUnavailable, Fenced) as e:
            logger.warning("namespace %s: no final snapshot (%s); the journal has every commit", self.namespace, e)

    def close(self) -> None:
        self._stop_writer()
        self._abandon_child()
        self.high_water.close()
        self.r.close()
