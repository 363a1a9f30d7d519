"""The registry's fields, how the loop reads them, and its commit protocol (``Registry``,
manager/registry.py, is this class plus the mutations; the store sees it as a ``StateView``,
manager/store/view.py).

The loop, the store and the recovery move the state only through these methods: ``take_log``,
``mark_committed``, ``mark_durable``, ``start_over``, ``restore``, ``discard_uncommitted``,
``rename`` and ``adopt`` (the store's and recovery's), ``take_dirty`` and ``take_orphan_events``
(the loop's). Every other change is a mutation record run by ``Registry.apply``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self

from kvpool.manager.core.kv_events import AllBlocksCleared, KVEvent
from kvpool.manager.core.pool import Pool
from kvpool.manager.node_tiers import NodeTiers
from kvpool.manager.pins import Pins
from kvpool.manager.state.attachment import Attachment
from kvpool.manager.state.entries import PoolEntry, Session, check_pools
from kvpool.manager.state.mutations import Mutation
from kvpool.shared.protocol import ManagerError, bad_field, short_repr

UNLIMITED = 1 << 62


class RegistryState:
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
        self.pins = Pins()  # retention pins (manager/pins.py)
        # Whether new pools queue KV events: False when nothing can ever receive them (the manager
        # publishes to no socket), which saves a third of a prefill step's CPU. What a subscriber
        # sees is unchanged: there is none. A pool recovered from a store queues them regardless.
        self.kv_events = kv_events
        self.session_timeout_s = session_timeout_s
        self.max_sessions, self.max_pools, self.max_blocks = max_sessions, max_pools, max_blocks
        self.sessions: dict[str, Session] = {}
        self.pools: dict[str, PoolEntry] = {}
        self.draining = False
        self.attachments: dict[str, Attachment] = {}  # vLLM servers attached with the attach op
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
        self.sessions, self.pools, self.draining, self.attachments = {}, {}, False, {}
        self.state_id = state_id

    def restore(self, sessions: list[Session], pools: list[PoolEntry], state_id: str, next_num: int,
                draining: bool, attachments: list[Attachment] = ()) -> None:
        """Fills this empty registry with a decoded state (manager/store/state_file.py)."""
        self.sessions = {s.sid: s for s in sessions}
        self.pools = {e.name: e for e in pools}
        self.attachments = {a.name: a for a in attachments}
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

    def adopt(self, other: Self) -> None:
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
        self.attachments = other.attachments
        self.next_num, self.state_id, self.durable = other.next_num, other.state_id, other.durable
        self.node, self.pins = other.node, other.pins  # the tiers the adopted pools use, their pins
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

    # -- reads ----------------------------------------------------------------------------

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

    def request_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.pools.values():
            if entry.pool is not None:
                for key in entry.pool.requests:
                    counts[key[0]] = counts.get(key[0], 0) + 1  # type: ignore[index]
        return counts

    def total_requests(self) -> int:
        return sum(len(e.pool.requests) for e in self.pools.values() if e.pool is not None)

    def check_invariants(self) -> None:
        """Every pool's invariants against the live sessions (``check_pools``, manager/state/entries.py).
        Raises InvariantBroken (explicit checks, not asserts: they hold under ``python -O``)."""
        check_pools(self.pools.values(), self.sessions)
        if self.node is not None:
            self.node.check_invariants()
