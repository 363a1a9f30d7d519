"""Every piece of the manager's state, in one object: pools (with their shards) and sessions.

The loop owns the registry; nothing else mutates it. A store snapshots it (manager/store/base.py).

- A *session* is one connected client (hello .. deregister or expiry). Its secret ``sid`` is
  the owner of its requests inside every pool (``run_step``'s owner), so one client can never
  touch another's requests; lists show its public number ``num`` instead of the sid.
- A *pool* is one model replica's block space, registered by ``shard_count`` shards. Once all
  have registered it gets a ``Pool`` of ``min`` over the shards' block counts and an epoch.
  A shard registering with a new incarnation (its process restarted: its KV tensors are new)
  replaces the Pool: cached hashes and requests are dropped and the epoch moves on.
- A pool of several shards whose shard's session ends (deregister, expiry) loses that shard: its
  slice of every block may be gone, so the Pool is dropped, the epoch moves on (older epochs get
  ``stale_epoch``) and the pool is pending until the shard registers again.
- A shard remembers how its session ended: ``sid`` None after a clean ``deregister``, the dead
  session's sid after an expiry. ``pool_health`` (manager/health.py) reads that: a pool whose
  workers all left cleanly is idle, one whose worker died is lost until it returns or is dropped.
"""

from __future__ import annotations

import logging
import secrets

from kvpool.manager.core.kv_events import AllBlocksCleared, KVEvent
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.manager.entries import GLOBAL, PoolEntry, Session, Shard, check_pools
from kvpool.manager.mutations import (
    BlocksEvicted,
    CacheReset,
    DrainingSet,
    Mutation,
    PoolDropped,
    SessionEnded,
    SessionOpened,
    ShardRegistered,
    StepRan,
)
from kvpool.manager.pool_forming import compatible, new_epoch, remove_shards, shard_blocks
from kvpool.shared.protocol import KVSpec, ManagerError, short_repr
from kvpool.shared.step_ops import decode_ops, encode_results

logger = logging.getLogger(__name__)


class Registry:
    def __init__(
        self,
        incarnation: str,
        *,
        session_timeout_s: float,
        max_sessions: int = 4096,
        max_pools: int = 256,
        max_blocks: int = 1 << 22,
        kv_events: bool = True,
    ) -> None:
        self.incarnation = incarnation
        # Whether new pools queue KV events: False when nothing can ever receive them (the manager
        # publishes to no socket), which saves a third of a prefill step's CPU. What a subscriber
        # sees is unchanged: there is none. A pool recovered from a store queues them regardless.
        self.kv_events = kv_events
        self.session_timeout_s = session_timeout_s
        self.max_sessions, self.max_pools, self.max_blocks = max_sessions, max_pools, max_blocks
        self.sessions: dict[str, Session] = {}
        self.pools: dict[str, PoolEntry] = {}
        self.draining = False
        self.dirty: set[str] = set()  # pool names (and GLOBAL) changed this iteration
        # KV events of pools dropped this iteration (a shard left): (pool, epoch, events)
        self.orphan_events: list[tuple[str, int, list[KVEvent]]] = []
        self.next_num = 1  # the public number of the next session
        # The identity of this state: the incarnation without persistence; a persistent store
        # replaces it with the id it keeps with the state, so it survives restarts and failovers.
        self.state_id = incarnation
        self.durable = False  # a persistent store holds this state (set by the store)
        self.seq = 0  # the store's last committed batch (its commit sequence); replies carry it
        # When a store journals (manager/store/journal.py): this iteration's mutations as records.
        self.log: list[Mutation] | None = None

    def record(self, rec: Mutation) -> None:
        if self.log is not None:
            self.log.append(rec)

    def apply(self, rec: Mutation, now: float) -> object:
        """The one way the state changes: runs ``rec`` and journals it. The named methods below
        (the live path) and the journal's replay both come here; returns what the method returns."""
        if type(rec) is StepRan:  # the hot path first
            return self._step(rec)
        if type(rec) is SessionOpened:
            return self._open_session(rec, now)
        if type(rec) is SessionEnded:
            return self._end_session(rec)
        if type(rec) is ShardRegistered:
            return self._register(rec)
        if type(rec) is CacheReset:
            return self._reset_cache(rec)
        if type(rec) is BlocksEvicted:
            return self._evict(rec)
        if type(rec) is DrainingSet:
            return self._set_draining(rec)
        if type(rec) is PoolDropped:
            return self._drop(rec)
        raise TypeError(f"not a registry mutation: {rec!r:.80}")

    def adopt(self, other: Registry) -> None:
        """Takes over the state a store loaded into ``other``; this object (which the loop,
        the handlers and the metrics hold) stays, with its incarnation and limits.

        A subscriber ends with the adopted view: each adopted pool restates its cache (a clear,
        then every hash), and each pool that had a cache here but has none in ``other`` (gone
        after a start-over or a reload, or not formed there) gets ``AllBlocksCleared`` on its
        topic, without which a subscriber would keep hashes the manager no longer has."""
        vanished = [(name, entry.epoch) for name, entry in self.pools.items()
                    if entry.pool is not None and entry.pool.blocks.events_enabled
                    and (name not in other.pools or other.pools[name].pool is None)]
        self.sessions, self.pools, self.draining = other.sessions, other.pools, other.draining
        self.next_num, self.state_id, self.durable = other.next_num, other.state_id, other.durable
        self.seq = other.seq
        self.log, self.dirty = other.log, set()
        self.orphan_events = [(name, epoch, [AllBlocksCleared()]) for name, epoch in vanished]
        for entry in self.pools.values():
            if entry.pool is not None:
                entry.pool.set_events(self.kv_events)  # a store loads pools with events on
                # Subscribers resynchronise to the recovered cache, both tiers, whatever they saw
                # before: the host map was journaled, and the workers that keep their process keep
                # the host tensors it names (a new incarnation starts a new epoch, dropping both).
                entry.pool.restate_events()

    # -- sessions --------------------------------------------------------------------------

    def open_session(self, identity: str, role: str, admin: bool, version: int, now: float) -> Session:
        """A new session, with a fresh secret sid."""
        return self.apply(SessionOpened(secrets.token_hex(16), identity, role, admin, version), now)  # type: ignore[return-value]

    def _open_session(self, rec: SessionOpened, now: float) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise ManagerError("too_many_sessions", f"{self.max_sessions} sessions are open; retry later")
        sess = Session(rec.sid, self.next_num, rec.identity, rec.role, rec.admin, rec.version, now, now)
        self.next_num += 1
        self.sessions[sess.sid] = sess
        self.dirty.add(GLOBAL)
        self.record(rec)
        return sess

    def end_session(self, sid: str, cause: str = "deregister") -> int:
        """Closes a session (``cause``: "deregister" or "expired"): frees its requests in every
        pool; returns how many. Its shards keep the sid when it expired (see ``pool_health``)."""
        return self.apply(SessionEnded(sid, cause), 0.0)  # type: ignore[return-value]

    def _end_session(self, rec: SessionEnded) -> int:
        sid = rec.sid
        if rec.cause not in ("deregister", "expired"):
            raise ValueError(f"a session ends by 'deregister' or 'expired', not {rec.cause!r}")
        self.sessions.pop(sid, None)
        self.dirty.add(GLOBAL)
        self.record(rec)
        freed = 0
        for entry in self.pools.values():
            lost = [r for r, shard in entry.shards.items() if shard.sid == sid]
            for r in lost:
                entry.shards[r].sid = None if rec.cause == "deregister" else sid
            pool = entry.pool
            if pool is None:
                if lost and entry.shard_count > 1:
                    self._forget_pending_shards(entry, lost)
                continue
            mine = [key for key in pool.requests if key[0] == sid]  # type: ignore[index]
            for key in mine:
                pool.free(key)
            if mine:
                self.dirty.add(entry.name)
                freed += len(mine)
            if lost and entry.shard_count > 1:
                self._lose_shards(entry, lost)
        return freed

    def _lose_shards(self, entry: PoolEntry, ranks: list[int]) -> None:
        """Shards of a multi-shard pool are gone: no block of the pool is whole any more. When all
        go, one stays (unbound) so the pool keeps its spec; the others' return re-forms it."""
        remove_shards(entry, ranks)
        self._drop_pool(entry)
        entry.epoch += 1
        self.dirty.add(entry.name)
        logger.warning("pool %s: shards %s left; epoch %d, cache and requests dropped until they register again",
                       entry.name, ranks, entry.epoch)

    def _forget_pending_shards(self, entry: PoolEntry, ranks: list[int]) -> None:
        """A waiting pool must not form with a shard whose process is gone: its registration is
        forgotten (one stays, unbound, when it is the last, so the pool keeps its spec)."""
        remove_shards(entry, ranks)
        self.dirty.add(entry.name)
        logger.info("pool %s: shards %s left before the pool formed", entry.name, ranks)

    def _drop_pool(self, entry: PoolEntry) -> None:
        """The entry's Pool is gone: subscribers drop its hashes now, not when it re-forms."""
        if entry.pool is not None and entry.pool.blocks.events_enabled:
            self.orphan_events.append((entry.name, entry.epoch, [*entry.pool.take_events(), AllBlocksCleared()]))
        entry.pool = None

    def expire(self, now: float) -> list[tuple[Session, int]]:
        """Ends every session silent past the timeout; returns (session, requests freed)."""
        limit = self.session_timeout_s
        dead = [s for s in self.sessions.values() if now - s.last_seen > limit]
        return [(s, self.end_session(s.sid, "expired")) for s in dead]

    def request_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.pools.values():
            if entry.pool is not None:
                for key in entry.pool.requests:
                    counts[key[0]] = counts.get(key[0], 0) + 1  # type: ignore[index]
        return counts

    # -- pools -----------------------------------------------------------------------------

    def register(
        self, sess: Session, name: str, rank: int, count: int, incarnation: str, spec: KVSpec, available: int,
        serve: dict | None = None,
        host_kv_bytes: int = 0,
        host_kv_policy: str = "demote",
    ) -> PoolEntry:
        """Registers one shard (idempotent for the same incarnation); see the module docstring.
        Who may (ownership, ``replace``) is checked before, in manager/guards.py."""
        rec = ShardRegistered(sess.sid, name, rank, count, incarnation, spec, available, self.max_blocks,
                              self.max_pools, serve, host_kv_bytes, host_kv_policy)
        return self.apply(rec, 0.0)  # type: ignore[return-value]

    def _register(self, rec: ShardRegistered) -> PoolEntry:
        # Journaled before anything can fail, checked against the record's limits (manager/mutations.py).
        self.record(rec)
        sess = self.sessions[rec.sid]
        name, rank, count, incarnation, spec, available = (
            rec.pool, rec.rank, rec.count, rec.incarnation, rec.spec, rec.available_kv_bytes)
        num_blocks = shard_blocks(rec)
        entry = self.pools.get(name)
        if entry is None:
            if len(self.pools) >= rec.max_pools:
                raise ManagerError("too_many_pools", f"{rec.max_pools} pools exist; no room for {name!r}")
            entry = self.pools[name] = PoolEntry(name, count)
        elif not compatible(entry, rank, count, spec, self.sessions):
            self._drop_pool(entry)
            entry = self.pools[name] = PoolEntry(name, count, epoch=entry.epoch)
        old = entry.shards.get(rank)
        if old is not None and old.incarnation == incarnation:
            if (old.spec != spec or old.available_kv_bytes != available or old.host_kv_bytes != rec.host_kv_bytes
                    or old.host_kv_policy != rec.host_kv_policy):
                raise ManagerError(
                    "shard_conflict",
                    f"shard {rank} of pool {name!r} is registered as incarnation {incarnation!r} with "
                    "another spec or size; a restarted shard must register with a new incarnation",
                )
            old.sid = sess.sid
            old.serve = rec.serve
            return entry
        entry.shards[rank] = Shard(rank, incarnation, spec, available, num_blocks, sess.sid, rec.serve,
                                   rec.host_kv_bytes, rec.host_kv_policy)
        if len(entry.shards) == entry.shard_count:
            new_epoch(entry, rec.max_blocks, self.kv_events)
        self.dirty.add(name)
        return entry

    def get_pool(self, name: object) -> PoolEntry:
        entry = self.pools.get(name) if type(name) is str else None  # type: ignore[arg-type]
        if entry is None:
            raise ManagerError("unknown_pool", f"no pool named {short_repr(name, 80)}; known: {sorted(self.pools)[:20]}")
        return entry

    def ready_pool(self, name: object, epoch: int | None = None) -> tuple[PoolEntry, Pool]:
        entry = self.get_pool(name)
        if epoch is not None and epoch != entry.epoch and (entry.pool is not None or entry.epoch > 0):
            raise ManagerError(
                "stale_epoch", f"pool {entry.name!r} is at epoch {entry.epoch}, not {epoch}", {"epoch": entry.epoch}
            )
        if entry.pool is None:
            raise ManagerError(
                "pool_not_ready", f"pool {entry.name!r}: {len(entry.shards)} of {entry.shard_count} shards registered"
            )
        if epoch is not None and epoch != entry.epoch:
            raise ManagerError(
                "stale_epoch", f"pool {entry.name!r} is at epoch {entry.epoch}, not {epoch}", {"epoch": entry.epoch}
            )
        return entry, entry.pool

    # -- pool mutations (each one journaled: replaying the records rebuilds the same state) -----

    def step(self, sess: Session, entry: PoolEntry, ops: list, msg_id: int,
             decoded: list | None = None) -> list[dict]:
        """Runs one step's sub-ops for ``sess`` (the caller checked the epoch); caches the
        results under ``msg_id`` so a retried step is answered, not run twice. ``ops`` as on
        the wire (journaled as they came); ``decoded``: their records, when the caller has them."""
        return self.apply(StepRan(sess.sid, msg_id, entry.name, ops, decoded), 0.0)  # type: ignore[return-value]

    def _step(self, rec: StepRan) -> list[dict]:
        sess, entry = self.sessions[rec.sid], self.pools[rec.pool]
        ops = rec.decoded if rec.decoded is not None else decode_ops(rec.ops)  # a replay decodes here
        results = encode_results(run_step(entry.pool, sess.sid, ops, allow_alloc=not self.draining))  # type: ignore[arg-type]
        sess.last_step_id, sess.last_step = rec.msg_id, results
        if rec.ops:
            self.dirty.add(entry.name)
            self.record(rec)
        return results

    def drop_pool(self, entry: PoolEntry) -> int:
        """Forgets a pool (admin ``drop_pool``): its requests are freed, subscribers told to
        clear it, its name and memory released. Returns how many requests were freed."""
        return self.apply(PoolDropped(entry.name), 0.0)  # type: ignore[return-value]

    def _drop(self, rec: PoolDropped) -> int:
        self.record(rec)
        entry = self.pools.pop(rec.pool)
        freed = len(entry.pool.requests) if entry.pool is not None else 0
        if entry.pool is not None and entry.pool.blocks.events_enabled:
            entry.pool.take_events()  # unpublished events of a pool going away: subscribers just clear it
        self._drop_pool(entry)
        self.dirty.add(GLOBAL)
        logger.warning("pool %s dropped (%d requests freed)", entry.name, freed)
        return freed

    def reset_cache(self, entry: PoolEntry, tier: str = "device") -> bool:
        return self.apply(CacheReset(entry.name, tier), 0.0)  # type: ignore[return-value]

    def _reset_cache(self, rec: CacheReset) -> bool:
        done = self.pools[rec.pool].pool.reset_prefix_cache(rec.tier)  # type: ignore[union-attr]
        if done:
            self.dirty.add(rec.pool)
            self.record(rec)
        return done

    def evict(self, entry: PoolEntry, n: int, tier: str = "device") -> int:
        return self.apply(BlocksEvicted(entry.name, n, tier), 0.0)  # type: ignore[return-value]

    def _evict(self, rec: BlocksEvicted) -> int:
        pool = self.pools[rec.pool].pool
        self.dirty.add(rec.pool)
        self.record(rec)
        return pool.evict(rec.n, rec.tier)  # type: ignore[union-attr]

    def set_draining(self, enable: bool) -> None:
        self.apply(DrainingSet(enable), 0.0)

    def _set_draining(self, rec: DrainingSet) -> None:
        self.draining = bool(rec.enable)
        self.dirty.add(GLOBAL)
        self.record(rec)

    def total_requests(self) -> int:
        return sum(len(e.pool.requests) for e in self.pools.values() if e.pool is not None)

    def check_invariants(self) -> None:
        """Every pool's invariants against the live sessions (``check_pools``, manager/entries.py).
        Raises InvariantBroken (explicit checks, not asserts: they hold under ``python -O``)."""
        check_pools(self.pools.values(), self.sessions)
