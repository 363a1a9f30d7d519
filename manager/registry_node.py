"""The registry's node-tier and retention mutations: a shard joining its layout's node tier, a
worker's node-tier batch finished, a retention pin added or removed (``Registry``,
manager/registry.py, is this mixin, the other mutations and ``RegistryState``; each record here
is journaled through ``Registry.apply`` like the others: manager/state/mutations.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.engine_node import engine_load, engine_save
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool import PIN_OWNER
from kvpool.manager.core.retention import PinRefused
from kvpool.manager.node_tiers import NodeTiers, NodeTierSettings
from kvpool.manager.state.entries import GLOBAL, PoolEntry, Session
from kvpool.manager.state.mutations import (
    EngineFinished,
    EngineLoaded,
    EngineSaved,
    NodeFinished,
    NodeJoined,
    PinAdded,
    PinRemoved,
    ShardRegistered,
)
from kvpool.manager.state.pins import DEFAULT_SHARE, Pin
from kvpool.shared.node_orders import Order, order_from_wire
from kvpool.shared.node_tier import NodeTierInfo, layout_id, shard_stores
from kvpool.shared.protocol import KVSpec, ManagerError

ENGINE = "engine"  # an engine batch's owner is (sid, ENGINE, batch): a pool's is (sid, n), n the tier's number

if TYPE_CHECKING:
    from kvpool.manager.registry_state import RegistryState

    Base = RegistryState
else:
    Base = object


class NodeMutations(Base):
    _apply: Any  # Registry._apply: runs and journals a record

    # -- the node tier ----------------------------------------------------------------------

    def node_settings(self, node_model: str | None) -> list | None:
        """The node-tier settings a registration offering ``node_model`` joins under (journaled
        with it: manager/node_tiers.py ``NodeTierSettings``); None: it joins none."""
        if node_model is None or self.node is None or self.node.settings is None:
            return None
        return self.node.settings.to_wire()

    def _node_layout(self, rec: ShardRegistered) -> str | None:
        """The layout of the node tier a pool's shard offered to map, created on first use under
        the settings journaled with the registration (None: no node tier, or none for it). Every
        shard of a tensor-parallel pool names the same tier, with one store per rank
        (shared/node_tier.py ``shard_stores``)."""
        if rec.node_tier is None or rec.node_model is None:
            return None
        if self.node is None:  # a replay on a manager that runs none: the live one did
            self.node = NodeTiers(None, self.kv_events)
        stores = shard_stores(rec.spec, rec.node_model, rec.count)
        info = self.node.join(stores[0], rec.spec.block_size, rec.spec.block_bytes,
                              NodeTierSettings.from_wire(rec.node_tier), stores if rec.count > 1 else ())
        return stores[0] if info is not None else None

    def relink(self, layout: str) -> None:
        """``layout``'s tier counts the formed pools in front of it (``NodeTier.links``, which
        decides whether they save eagerly): exact as pools form and go, as a recovery counts."""
        tier = self.node.tiers.get(layout) if self.node is not None else None
        if tier is not None:
            tier.set_links(sum(1 for e in self.pools.values()
                               if e.pool is not None and e.pool.node is not None and e.node_layout == layout))

    def node_info(self, entry: PoolEntry) -> NodeTierInfo | None:
        """Where the node tier of ``entry``'s pool lives (register's reply), its files set up
        first (manager/node_tiers.py ``ensure_files``)."""
        layout = entry.node_layout
        if self.node is None or layout is None:
            return None
        self.node.ensure_files(layout)
        return self.node.info.get(layout)

    def node_finish(self, sess: Session, entry: PoolEntry, batch: int, failed: list, late: list) -> bool:
        """A worker ran its step ``batch``'s node-tier orders; ``failed`` did not land and
        ``late`` missed its disk deadline (wire maps, checked by the caller against the batch).
        False: no such batch (abandoned, or of another manager): nothing changes."""
        return self._apply(NodeFinished(sess.sid, entry.name, batch, failed, late), type(self)._node_finish, 0.0)

    def _node_finish(self, rec: NodeFinished, now: float) -> bool:
        pool = self.pools[rec.pool].pool
        if pool is None or pool.node is None or (rec.sid, rec.batch) not in pool.node.tier.batches:
            return False
        pool.node.tier.finish((rec.sid, rec.batch), [order_from_wire(o) for o in rec.failed],
                              [order_from_wire(o) for o in rec.late])
        self.dirty.add(rec.pool)
        return True

    # -- engines that own their device blocks (manager/core/engine_node.py) --------------------

    def node_join(self, sess: Session, spec: KVSpec, model: str, rank: int, world: int) -> NodeTierInfo:
        """The node tier of the engine's layout, created on first use; ManagerError
        ``no_node_tier`` when the manager keeps none or has no room for another layout."""
        settings = self.node.settings.to_wire() if self.node is not None and self.node.settings is not None else None
        rec = NodeJoined(sess.sid, spec.to_wire(), model, rank, world, settings)
        return self._apply(rec, type(self)._node_join, 0.0)

    def _node_join(self, rec: NodeJoined, now: float) -> NodeTierInfo:
        if rec.node_tier is None:
            raise ManagerError("no_node_tier", "this manager keeps no node tier: start it with "
                               "--node-tier-memory SIZE (kvpool manager --help)")
        if self.node is None:  # a replay on a manager that runs none: the live one did
            self.node = NodeTiers(None, self.kv_events)
        spec = KVSpec.from_wire(rec.spec)
        layout = layout_id(spec, rec.model, rec.rank, rec.world).hex()
        info = self.node.join(layout, spec.block_size, spec.block_bytes, NodeTierSettings.from_wire(rec.node_tier))
        if info is None:
            raise ManagerError("no_node_tier", f"layout {layout} gets no node tier: node_tier_max_layouts layouts "
                               "have one already, or node_tier_memory holds no block of it (the manager's log "
                               "names which)")
        self.node.tiers[layout].join_engine(rec.sid)
        self.dirty.add(GLOBAL)
        return info

    def engine_tier(self, layout: object) -> NodeTier:
        """The tier of ``layout`` (16 hex digits); ManagerError ``unknown_layout`` when none."""
        tier = self.node.tiers.get(layout) if self.node is not None and type(layout) is str else None
        if tier is None:
            raise ManagerError("unknown_layout", f"no node tier of layout {str(layout)[:32]!r} here: node_join it "
                               "first (a restarted manager starts with none)")
        return tier

    def engine_load(self, sess: Session, layout: str, batch: int, hashes: list[bytes],
                    priority: int) -> tuple[int, list[Order]]:
        rec = EngineLoaded(sess.sid, layout, batch, hashes, priority)
        return self._apply(rec, type(self)._engine_load, 0.0)

    def _engine_load(self, rec: EngineLoaded, now: float) -> tuple[int, list[Order]]:
        self.dirty.add(GLOBAL)
        return engine_load(self.engine_tier(rec.layout), (rec.sid, ENGINE, rec.batch), rec.hashes, rec.priority)

    def engine_save(self, sess: Session, layout: str, batch: int, blocks: list[int], hashes: list[bytes],
                    parents: list[bytes | None], priority: int) -> list[Order]:
        rec = EngineSaved(sess.sid, layout, batch, blocks, hashes, parents, priority)
        return self._apply(rec, type(self)._engine_save, 0.0)

    def _engine_save(self, rec: EngineSaved, now: float) -> list[Order]:
        self.dirty.add(GLOBAL)
        return engine_save(self.engine_tier(rec.layout), (rec.sid, ENGINE, rec.batch), rec.blocks, rec.hashes,
                           rec.parents, rec.priority)

    def engine_finish(self, sess: Session, layout: str, batch: int, failed: list, late: list) -> bool:
        """An engine ran its ``batch``; ``failed`` did not land and ``late`` missed its disk
        deadline (wire maps, checked by the caller against the batch). False: no such batch
        (abandoned, or of an earlier manager)."""
        return self._apply(EngineFinished(sess.sid, layout, batch, failed, late), type(self)._engine_finish, 0.0)

    def _engine_finish(self, rec: EngineFinished, now: float) -> bool:
        tier = self.node.tiers.get(rec.layout) if self.node is not None else None
        owner = (rec.sid, ENGINE, rec.batch)
        if tier is None or owner not in tier.batches:
            return False
        tier.finish(owner, [order_from_wire(o) for o in rec.failed], [order_from_wire(o) for o in rec.late])
        self.dirty.add(GLOBAL)
        return True

    # -- retention pins (manager/state/pins.py) ------------------------------------------------------

    def pin(self, entry: PoolEntry, hashes: list[bytes], ttl_s: float, now: float) -> Pin:
        """A retention pin of ``hashes`` in ``entry``'s pool and node tier (``now``: wall-clock
        seconds); ManagerError ``pin_refused`` (nothing changed) past a tier's pinned share."""
        settings = self.node.settings if self.node is not None else None
        share = settings.pin_share if settings is not None else DEFAULT_SHARE
        return self._apply(PinAdded(entry.name, hashes, ttl_s, now, share), type(self)._pin, 0.0)

    def _pin(self, rec: PinAdded, now: float) -> Pin:
        entry = self.pools[rec.pool]
        pool = entry.pool
        if pool is None:
            raise ManagerError("pool_not_ready", f"pool {rec.pool!r} is not ready")
        pin_id, share = self.pins.next_id, rec.share
        # every refusal is decided before anything changes: a refused pin is not journaled, so
        # it must leave no trace (not even a pin id taken in the tier) a replay would lack
        if not pool.pin_fits(rec.hashes, share):
            limit = int(share * (pool.blocks.num_blocks - 1))
            raise ManagerError("pin_refused", f"pin refused: its {len(pool.blocks.lookup(rec.hashes))} cached device "
                               f"blocks join the {pool.pinned_blocks()} pinned in pool {rec.pool!r}, which keeps at "
                               f"most {limit} pinned ({share:.0%} of {pool.blocks.num_blocks - 1} blocks): unpin some "
                               "or pin a shorter prefix")
        node_pin = None
        if pool.node is not None:
            got = pool.node.tier.pin(rec.hashes, rec.ttl_s, rec.now)
            if isinstance(got, PinRefused):
                raise ManagerError("pin_refused", f"node tier: {got.message}")
            node_pin = got
        held = pool.pin((PIN_OWNER, pin_id), rec.hashes, share)
        if held is None:  # pin_fits said it fits
            raise InvariantBroken(f"pin {pin_id}: refused by the pool after it fit")
        pin = self.pins.pins[self.pins.take_id()] = Pin(pin_id, rec.pool, tuple(rec.hashes), rec.now + rec.ttl_s,
                                                        node_pin, entry.node_layout, held)
        self.dirty.add(rec.pool)
        return pin

    def unpin(self, pin_id: int, expired: bool = False) -> bool:
        return self._apply(PinRemoved(pin_id, expired), type(self)._unpin, 0.0)

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
