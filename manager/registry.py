"""Every piece of the manager's state, in one object: pools (with their shards) and sessions.

The loop owns the registry and it is the one writer of its state: every change is a mutation
record (manager/state/mutations.py) run by ``apply``, which journals it once; the store and the
recovery move it only through its commit protocol (``take_log``, ``mark_committed``,
``mark_durable``, ``start_over``, ``restore``, ``discard_uncommitted``), the loop through
``take_dirty`` and ``take_orphan_events``. The store sees it as a ``StateView``
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvpool.manager.core.kv_events import AllBlocksCleared, KVEvent
from kvpool.manager.core.pool import PIN_OWNER, Pool
from kvpool.manager.core.retention import PinRefused
from kvpool.manager.core.step import run_step
from kvpool.manager.node_tiers import NodeTiers
from kvpool.manager.pins import DEFAULT_SHARE, Pin, PinTable
from kvpool.manager.pool_forming import compatible, new_epoch, remove_shards, shard_blocks
from kvpool.manager.state.entries import GLOBAL, PoolEntry, Session, Shard, check_pools
from kvpool.manager.state.mutations import (
    BlocksEvicted,
    CacheReset,
    DrainingSet,
    Mutation,
    NodeFinished,
    PinAdded,
    PinRemoved,
    PoolDropped,
    SessionEnded,
    SessionOpened,
    ShardRegistered,
    StepRan,
)
from kvpool.shared.node_orders import order_from_wire
from kvpool.shared.node_tier import NodeTierInfo, layout_id
from kvpool.shared.protocol import KVSpec, ManagerError, bad_field, short_repr
from kvpool.shared.step_ops import decode_ops, encode_results

logger = logging.getLogger(__name__)
R = TypeVar("R")
UNLIMITED = 1 << 62
# When ``apply`` journals a record: before it runs (a registration: replayed, it fails or succeeds
# as it did live), once it ran, or once it ran and its result says it changed something (a step
# with sub-ops, a reset that found no block in use).
BEFORE, AFTER, IF_CHANGED = "before", "after", "if_changed"


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
        node_tiers: NodeTiers | None = None,
    ) -> None:
        self.incarnation = incarnation
        self.node = node_tiers  # the node tier of each KV layout (manager/node_tiers.py); None: off
        self.pins = PinTable()  # retention pins (manager/pins.py)
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
        self.durable = False  # a persistent store holds this state (mark_durable)
        self.seq = 0  # the store's last committed batch (its commit sequence); replies carry it
        # When a store journals (manager/store/journal.py): this iteration's mutations as records.
        self.log: list[Mutation] | None = None

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

    # -- the commit protocol (the loop, the store and the recovery call these) ---------------

    def mark_durable(self) -> None:
        """A persistent store holds this state from now on: every mutation is journaled."""
        self.durable, self.log, self.dirty = True, [], set()

    def take_log(self) -> list[Mutation]:
        """This iteration's mutation records, for the store to commit (journaling goes on)."""
        log = self.log
        if not log:
            return []
        self.log = []
        return log

    def mark_committed(self, seq: int) -> None:
        """The store committed its batch ``seq``: replies say so from now on."""
        self.seq = seq

    def take_dirty(self) -> set[str]:
        """What changed this iteration (pool names, GLOBAL); cleared."""
        dirty = self.dirty
        if dirty:
            self.dirty = set()
        return dirty

    def take_orphan_events(self) -> list[tuple[str, int, list[KVEvent]]]:
        """KV events of pools dropped this iteration, (pool, epoch, events); cleared."""
        events = self.orphan_events
        if not events:
            return []
        self.orphan_events = []
        return events

    def discard_uncommitted(self) -> None:
        """A commit failed: nothing of this iteration is kept for a commit or published (the
        state itself is no longer trusted; the recovery reloads it)."""
        for entry in self.pools.values():
            if entry.pool is not None:
                entry.pool.take_events()
        self.log, self.dirty = [], set()

    def rename(self, state_id: str) -> None:
        """This state is served under ``state_id`` (a new namespace, a restore as a new state)."""
        self.state_id = state_id

    def start_over(self, state_id: str) -> None:
        """An empty state under a new id, instead of one that went back in time (the store)."""
        self.sessions, self.pools, self.draining = {}, {}, False
        self.state_id = state_id

    def restore(self, sessions: list[Session], pools: list[PoolEntry], state_id: str, next_num: int,
                draining: bool) -> None:
        """Fills this empty registry with a decoded state (manager/store/state_file.py)."""
        self.sessions = {s.sid: s for s in sessions}
        self.pools = {e.name: e for e in pools}
        self.state_id, self.next_num, self.draining = state_id, next_num, bool(draining)

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """The journal's replay: opens were checked against the session limit when they happened."""
        max_sessions, self.max_sessions = self.max_sessions, UNLIMITED
        try:
            yield
        finally:
            self.max_sessions = max_sessions

    def start_clocks(self, now: float) -> None:
        """Every session's expiry counts from ``now``: a loaded state starts serving, and each
        client has a full session timeout from then, however long the load took (PROTOCOL.md
        section 11)."""
        for sess in self.sessions.values():
            sess.seen(now)

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
        self.node = other.node  # the tiers the adopted pools use
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
        entry.lose_pool(next_epoch)

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
        node_model: str | None = None,
    ) -> PoolEntry:
        """Registers one shard (idempotent for the same incarnation); see the module docstring.
        Who may (ownership, ``replace``) is checked before, in manager/guards.py."""
        rec = ShardRegistered(sess.sid, name, rank, count, incarnation, spec, available, self.max_blocks,
                              self.max_pools, serve, host_kv_bytes, host_kv_policy, node_model)
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

    def _node_layout(self, rec: ShardRegistered) -> str | None:
        """The layout of the node tier a single-shard pool's worker offered to map, created on
        first use (None: no node tier, or none for it)."""
        if self.node is None or rec.node_model is None or rec.count != 1:
            return None
        layout = layout_id(rec.spec, rec.node_model, rec.rank, rec.count).hex()
        info = self.node.join(layout, rec.spec.block_size, rec.spec.block_bytes)
        return layout if info is not None else None

    def node_info(self, entry: PoolEntry) -> NodeTierInfo | None:
        """Where the node tier of ``entry``'s pool lives (register's reply)."""
        layout = entry.node_layout
        return self.node.info.get(layout) if self.node is not None and layout is not None else None

    def _form_if_whole(self, entry: PoolEntry, max_blocks: int) -> None:
        """The pool forms (in a new epoch) once every rank is registered by a live session: a shard
        that left (deregistered, expired) and stays only to keep the pool's spec does not count."""
        if entry.live_shards(self.sessions) == entry.shard_count:
            new_epoch(entry, max_blocks, self.kv_events)
            layout = entry.node_layout
            if layout is not None and self.node is not None:
                entry.pool.set_node(self.node.tiers[layout])  # type: ignore[union-attr]
            self.dirty.add(entry.name)

    def get_pool(self, name: object) -> PoolEntry:
        if type(name) is not str:
            raise bad_field("pool", "a pool name (a string)", name)
        entry = self.pools.get(name)
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
                "pool_not_ready",
                f"pool {entry.name!r}: {entry.live_shards(self.sessions)} of {entry.shard_count} shards registered"
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
        return self._apply(StepRan(sess.sid, msg_id, entry.name, ops, decoded), Registry._step, 0.0)

    def _step(self, rec: StepRan, now: float) -> list[dict]:
        sess, entry = self.sessions[rec.sid], self.pools[rec.pool]
        ops = rec.decoded if rec.decoded is not None else decode_ops(rec.ops)  # a replay decodes here
        results = encode_results(run_step(entry.pool, sess.sid, ops, allow_alloc=not self.draining,  # type: ignore[arg-type]
                                          batch=rec.msg_id))
        sess.remember_step(rec.msg_id, results)
        if rec.ops:  # journaled only then (IF_CHANGED: one result per sub-op)
            self.dirty.add(entry.name)
        return results

    def node_finish(self, sess: Session, entry: PoolEntry, batch: int, failed: list) -> bool:
        """A worker ran its step ``batch``'s node-tier orders; ``failed`` (wire maps, checked by
        the caller against the batch) did not land. False: no such batch (abandoned, or of
        another manager): nothing changes."""
        return self._apply(NodeFinished(sess.sid, entry.name, batch, failed), Registry._node_finish, 0.0)

    def _node_finish(self, rec: NodeFinished, now: float) -> bool:
        pool = self.pools[rec.pool].pool
        if pool is None or pool.node is None or (rec.sid, rec.batch) not in pool.node.tier.batches:
            return False
        pool.node.tier.finish((rec.sid, rec.batch), [order_from_wire(o) for o in rec.failed])
        self.dirty.add(rec.pool)
        return True

    def pin(self, entry: PoolEntry, hashes: list[bytes], ttl_s: float, now: float) -> Pin:
        """A retention pin of ``hashes`` in ``entry``'s pool and node tier (``now``: wall-clock
        seconds); ManagerError ``pin_refused`` (nothing changed) past a tier's pinned share."""
        return self._apply(PinAdded(entry.name, hashes, ttl_s, now), Registry._pin, 0.0)

    def _pin(self, rec: PinAdded, now: float) -> Pin:
        pool = self.pools[rec.pool].pool
        if pool is None:
            raise ManagerError("pool_not_ready", f"pool {rec.pool!r} is not ready")
        pin_id = self.pins.next_id
        node_pin = None
        if pool.node is not None:
            got = pool.node.tier.pin(rec.hashes, rec.ttl_s, rec.now)
            if isinstance(got, PinRefused):
                raise ManagerError("pin_refused", f"node tier: {got.message}")
            node_pin = got
        share = self.node.settings.pin_share if self.node is not None else DEFAULT_SHARE
        held = pool.pin((PIN_OWNER, pin_id), rec.hashes, share)
        if held is None:
            if node_pin is not None:
                pool.node.tier.unpin(node_pin)  # type: ignore[union-attr]
            limit = int(share * (pool.blocks.num_blocks - 1))
            raise ManagerError("pin_refused", f"pin refused: its {len(pool.blocks.lookup(rec.hashes))} cached device "
                               f"blocks join the {pool.pinned_blocks()} pinned in pool {rec.pool!r}, which keeps at "
                               f"most {limit} pinned ({share:.0%} of {pool.blocks.num_blocks - 1} blocks): unpin some "
                               "or pin a shorter prefix")
        pin = self.pins.pins[self.pins.take_id()] = Pin(pin_id, rec.pool, tuple(rec.hashes), rec.now + rec.ttl_s,
                                                        node_pin, self.pools[rec.pool].node_layout, held)
        self.dirty.add(rec.pool)
        return pin

    def unpin(self, pin_id: int, expired: bool = False) -> bool:
        return self._apply(PinRemoved(pin_id, expired), Registry._unpin, 0.0)

    def _unpin(self, rec: PinRemoved, now: float) -> bool:
        pin = self.pins.pins.pop(rec.pin_id, None)
        if pin is None:
            return False
        entry = self.pools.get(pin.pool)
        pool = entry.pool if entry is not None else None
        key = (PIN_OWNER, pin.pin_id)
        if pool is not None and key in pool.requests:  # (a re-formed pool holds none)
            pool.free(key)
        tier = self.node.tiers.get(pin.layout) if self.node is not None and pin.layout is not None else None
        if tier is not None and pin.node_pin is not None:  # the layout's tier outlives its pools
            tier.unpin(pin.node_pin, expired=rec.expired)
        self.dirty.add(pin.pool if entry is not None else GLOBAL)
        return True

    def expire_pins(self, now: float) -> list[int]:
        """Ends the pins whose time is up at wall-clock ``now``."""
        due = self.pins.due(now)
        for pin_id in due:
            self.unpin(pin_id, expired=True)
        return due

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

    def total_requests(self) -> int:
        return sum(len(e.pool.requests) for e in self.pools.values() if e.pool is not None)

    def check_invariants(self) -> None:
        """Every pool's invariants against the live sessions (``check_pools``, manager/state/entries.py).
        Raises InvariantBroken (explicit checks, not asserts: they hold under ``python -O``)."""
        check_pools(self.pools.values(), self.sessions)
        if self.node is not None:
            self.node.check_invariants()


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
}
_RUN = {kind: run for kind, (run, _) in _TABLE.items()}
_WHEN = {kind: when for kind, (_, when) in _TABLE.items()}
