"""Every piece of the manager's state, in one object: pools (with their shards) and sessions.

The loop owns the registry and it is the one writer of its state: every change is a mutation
record (manager/state/mutations.py) run by ``apply``, which journals it once; the store and the
recovery move it only through its commit protocol (manager/registry_state.py: ``take_log``,
``mark_committed``, ``mark_durable``, ``start_over``, ``restore``, ``discard_uncommitted``), the
loop through ``take_dirty`` and ``take_orphan_events``. The store sees it as a ``StateView``
(manager/store/view.py), so it never imports this module.

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
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.manager.core.kv_events import AllBlocksCleared
from kvpool.manager.core.step import run_step
from kvpool.manager.pool_forming import compatible, new_epoch, remove_shards, shard_blocks
from kvpool.manager.registry_node import NodeMutations
from kvpool.manager.registry_state import RegistryState
from kvpool.manager.state.attachment import Attachment
from kvpool.manager.state.entries import GLOBAL, PoolEntry, Session, Shard
from kvpool.manager.state.mutations import (
    BlocksEvicted,
    CacheReset,
    DrainingSet,
    EngineFinished,
    EngineLoaded,
    EngineSaved,
    ExternalAttached,
    ExternalDetached,
    Mutation,
    NodeFinished,
    NodeJoined,
    PinAdded,
    PinRemoved,
    PoolDropped,
    SessionEnded,
    SessionOpened,
    ShardRegistered,
    StepRan,
)
from kvpool.shared.protocol import KVSpec, ManagerError
from kvpool.shared.step_ops import decode_ops, encode_results

logger = logging.getLogger(__name__)
R = TypeVar("R")
# When ``apply`` journals a record: before it runs (a registration: replayed, it fails or succeeds
# as it did live), once it ran, or once it ran and its result says it changed something (a step
# with sub-ops, a reset that found no block in use).
BEFORE, AFTER, IF_CHANGED = "before", "after", "if_changed"


class Registry(NodeMutations, RegistryState):
    """The state (its fields, reads and commit protocol: ``RegistryState``) and every change to
    it, each a mutation record run by ``apply``."""

    def apply(self, rec: Mutation, now: float) -> object:
        """The one way the state changes: runs ``rec`` and journals it (once, at the point
        ``_RUN`` names for its type). The named methods below (the live path) and the journal's
        replay both come here; returns what the record's method returns."""
        run = _RUN.get(type(rec))
        if run is None:
            raise TypeError(f"not a registry mutation: {rec!r:.80}")
        return self._apply(rec, run, now)

    def _apply(self, rec: Any, run: Callable[[Registry, Any, float], R], now: float) -> R:
        when = _WHEN[type(rec)]
        log = self.log
        if log is not None and when is BEFORE:
            log.append(rec)
        result = run(self, rec, now)
        if log is not None and (when is AFTER or (when is IF_CHANGED and result)):
            log.append(rec)
        return result

    # -- sessions --------------------------------------------------------------------------

    def open_session(self, identity: str, role: str, admin: bool, version: int, now: float) -> Session:
        """A new session, with a fresh secret sid."""
        rec = SessionOpened(secrets.token_hex(16), identity, role, admin, version)
        return self._apply(rec, Registry._open_session, now)

    def _open_session(self, rec: SessionOpened, now: float) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise ManagerError("too_many_sessions", f"{self.max_sessions} sessions are open; retry later")
        sess = Session(rec.sid, self.next_num, rec.identity, rec.role, rec.admin, rec.version, now, now)
        self.next_num += 1
        self.sessions[sess.sid] = sess
        self.dirty.add(GLOBAL)
        return sess

    def end_session(self, sid: str, cause: str = "deregister") -> int:
        """Closes a session (``cause``: "deregister" or "expired"): frees its requests in every
        pool; returns how many. Its shards keep the sid when it expired (see ``pool_health``)."""
        return self._apply(SessionEnded(sid, cause), Registry._end_session, 0.0)

    def _end_session(self, rec: SessionEnded, now: float) -> int:
        sid = rec.sid
        if rec.cause not in ("deregister", "expired"):
            raise ValueError(f"a session ends by 'deregister' or 'expired', not {rec.cause!r}")
        self.sessions.pop(sid, None)
        self.dirty.add(GLOBAL)
        if self.node is not None:
            self.node.abandon(sid)
        freed = 0
        for entry in self.pools.values():
            lost = [r for r, shard in entry.shards.items() if shard.sid == sid]
            for r in lost:
                entry.shards[r].session_ended(rec.cause)
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
        self._drop_pool(entry, next_epoch=True)
        self.dirty.add(entry.name)
        logger.warning("pool %s: shards %s left; epoch %d, cache and requests dropped until they register again",
                       entry.name, ranks, entry.epoch)

    def _forget_pending_shards(self, entry: PoolEntry, ranks: list[int]) -> None:
        """A waiting pool must not form with a shard whose process is gone: its registration is
        forgotten (one stays, unbound, when it is the last, so the pool keeps its spec)."""
        remove_shards(entry, ranks)
        self.dirty.add(entry.name)
        logger.info("pool %s: shards %s left before the pool formed", entry.name, ranks)

    def _drop_pool(self, entry: PoolEntry, next_epoch: bool = False) -> None:
        """The entry's Pool is gone: subscribers drop its hashes now, not when it re-forms."""
        if entry.pool is not None and entry.pool.blocks.events_enabled:
            self.orphan_events.append((entry.name, entry.epoch, [*entry.pool.take_events(), AllBlocksCleared()]))
        layout = entry.node_layout if entry.pool is not None else None
        entry.lose_pool(next_epoch)
        if layout is not None:
            self.relink(layout)

    def expire(self, now: float) -> list[tuple[Session, int]]:
        """Ends every session silent past the timeout; returns (session, requests freed)."""
        limit = self.session_timeout_s
        dead = [s for s in self.sessions.values() if now - s.last_seen > limit]
        return [(s, self.end_session(s.sid, "expired")) for s in dead]

    # -- pools -----------------------------------------------------------------------------

    def register(
        self, sess: Session, name: str, rank: int, count: int, incarnation: str, spec: KVSpec, available: int,
        serve: dict | None = None,
        host_kv_bytes: int = 0,
        host_kv_policy: str = "demote",
        node_model: str | None = None,
    ) -> PoolEntry:
        """Registers one shard (idempotent for the same incarnation); see the module docstring.
        Who may (ownership, ``replace``) is checked before, in manager/guards.py."""
        rec = ShardRegistered(sess.sid, name, rank, count, incarnation, spec, available, self.max_blocks,
                              self.max_pools, serve, host_kv_bytes, host_kv_policy, node_model,
                              self.node_settings(node_model))
        return self._apply(rec, Registry._register, 0.0)

    def _register(self, rec: ShardRegistered, now: float) -> PoolEntry:
        # Journaled before anything can fail (BEFORE), checked against the record's limits
        # (manager/state/mutations.py).
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
            old.rebind(sess.sid, rec.serve)
            if entry.pool is None:  # it may be the last shard the pool waited for
                self._form_if_whole(entry, rec.max_blocks)
            return entry
        entry.shards[rank] = Shard(rank, incarnation, spec, available, num_blocks, sess.sid, rec.serve,
                                   rec.host_kv_bytes, rec.host_kv_policy, self._node_layout(rec))
        self._form_if_whole(entry, rec.max_blocks)  # a new incarnation of a formed pool: a new epoch
        self.dirty.add(name)
        return entry

    def _form_if_whole(self, entry: PoolEntry, max_blocks: int) -> None:
        """The pool forms (in a new epoch) once every rank is registered by a live session: a shard
        that left (deregistered, expired) and stays only to keep the pool's spec does not count."""
        if entry.live_shards(self.sessions) == entry.shard_count:
            new_epoch(entry, max_blocks, self.kv_events)
            layout = entry.node_layout
            if layout is not None and self.node is not None:
                entry.pool.set_node(self.node.tiers[layout])  # type: ignore[union-attr]
                self.relink(layout)
            self.dirty.add(entry.name)

    # -- pool mutations (each one journaled: replaying the records rebuilds the same state) -----

    def step(self, sess: Session, entry: PoolEntry, ops: list, msg_id: int,
             decoded: list | None = None) -> list[dict]:
        """Runs one step's sub-ops for ``sess`` (the caller checked the epoch); caches the
        results under ``msg_id`` so a retried step is answered, not run twice. ``ops`` as on
        the wire (journaled as they came); ``decoded``: their records, when the caller has them."""
        return self._apply(StepRan(sess.sid, msg_id, entry.name, ops, decoded), Registry._step, 0.0)

    def _step(self, rec: StepRan, now: float) -> list[dict]:
        sess, entry = self.sessions[rec.sid], self.pools[rec.pool]
        ops = rec.decoded if rec.decoded is not None else decode_ops(rec.ops)  # a replay decodes here
        results = encode_results(run_step(entry.pool, sess.sid, ops, allow_alloc=not self.draining))  # type: ignore[arg-type]
        sess.remember_step(rec.msg_id, results)
        if rec.ops:  # journaled only then (IF_CHANGED: one result per sub-op)
            self.dirty.add(entry.name)
        return results

    def drop_pool(self, entry: PoolEntry) -> int:
        """Forgets a pool (admin ``drop_pool``): its requests are freed, subscribers told to
        clear it, its name and memory released. Returns how many requests were freed."""
        return self._apply(PoolDropped(entry.name), Registry._drop, 0.0)

    def _drop(self, rec: PoolDropped, now: float) -> int:
        entry = self.pools.pop(rec.pool)
        freed = len(entry.pool.requests) if entry.pool is not None else 0
        if entry.pool is not None and entry.pool.blocks.events_enabled:
            entry.pool.take_events()  # unpublished events of a pool going away: subscribers just clear it
        self._drop_pool(entry)
        self.dirty.add(GLOBAL)
        logger.warning("pool %s dropped (%d requests freed)", entry.name, freed)
        return freed

    def reset_cache(self, entry: PoolEntry, tier: str = "device") -> bool:
        return self._apply(CacheReset(entry.name, tier), Registry._reset_cache, 0.0)

    def _reset_cache(self, rec: CacheReset, now: float) -> bool:
        done = self.pools[rec.pool].pool.reset_prefix_cache(rec.tier)  # type: ignore[union-attr]
        if done:
            self.dirty.add(rec.pool)
        return done

    def evict(self, entry: PoolEntry, n: int, tier: str = "device") -> int:
        return self._apply(BlocksEvicted(entry.name, n, tier), Registry._evict, 0.0)

    def _evict(self, rec: BlocksEvicted, now: float) -> int:
        pool = self.pools[rec.pool].pool
        self.dirty.add(rec.pool)
        return pool.evict(rec.n, rec.tier)  # type: ignore[union-attr]

    def set_draining(self, enable: bool) -> None:
        self._apply(DrainingSet(enable), Registry._set_draining, 0.0)

    def _set_draining(self, rec: DrainingSet, now: float) -> None:
        self.draining = bool(rec.enable)
        self.dirty.add(GLOBAL)

    # -- attached vLLM servers (manager/external/) ---------------------------------------------

    def attach(self, spec: Attachment) -> None:
        """Remembers an attachment made with the attach op (journaled: it survives the manager)."""
        self._apply(ExternalAttached(spec), Registry._attach, 0.0)

    def _attach(self, rec: ExternalAttached, now: float) -> None:
        self.attachments[rec.spec.name] = rec.spec
        self.dirty.add(GLOBAL)

    def detach(self, name: str) -> bool:
        return self._apply(ExternalDetached(name), Registry._detach, 0.0)

    def _detach(self, rec: ExternalDetached, now: float) -> bool:
        self.dirty.add(GLOBAL)
        return self.attachments.pop(rec.name, None) is not None


# The dispatch of ``apply``: record type -> (its method, when it is journaled).
_TABLE: dict[type, tuple[Callable[[Registry, Any, float], object], str]] = {
    StepRan: (Registry._step, IF_CHANGED),
    SessionOpened: (Registry._open_session, AFTER),
    SessionEnded: (Registry._end_session, AFTER),
    ShardRegistered: (Registry._register, BEFORE),
    CacheReset: (Registry._reset_cache, IF_CHANGED),
    BlocksEvicted: (Registry._evict, AFTER),
    DrainingSet: (Registry._set_draining, AFTER),
    PoolDropped: (Registry._drop, AFTER),
    NodeFinished: (Registry._node_finish, IF_CHANGED),
    PinAdded: (Registry._pin, AFTER),
    PinRemoved: (Registry._unpin, IF_CHANGED),
    NodeJoined: (Registry._node_join, AFTER),
    EngineLoaded: (Registry._engine_load, AFTER),
    EngineSaved: (Registry._engine_save, AFTER),
    EngineFinished: (Registry._engine_finish, IF_CHANGED),
    ExternalAttached: (Registry._attach, AFTER),
    ExternalDetached: (Registry._detach, IF_CHANGED),
}
_RUN = {kind: run for kind, (run, _) in _TABLE.items()}
_WHEN = {kind: when for kind, (_, when) in _TABLE.items()}
