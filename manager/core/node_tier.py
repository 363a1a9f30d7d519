"""The node tier: one store behind every pool of one KV layout on a node, host memory then disk.

Pure Python, no I/O. The manager keeps the bookkeeping; workers move the bytes
(worker/node_store.py) as the orders say (manager/core/node_orders.py). Two levels
(manager/core/node_level.py): ``host``, a shared host-memory segment every worker of the layout
maps, and ``disk``, files under a directory with a byte budget (optional). Pools of one layout
share the tier, so a prefix one worker computed is loaded by another pool's worker.

Batches. The orders of one *owner* (a pool's step, or any unit whose copies a worker reports done
together) form a batch. Every slot a batch reads or writes is referenced until ``finish(owner)``
(a shared level cannot end pins at a step's end as the private host tier does: another pool's
step comes in between, and the copies of this one may still be running). A slot a batch writes
is *landing* until then: unreadable, so no batch loads bytes that are not there yet. The orders
one call returns run in the order given (a victim's write-down reads its slot before the save
that overwrites it); orders of different calls touch different slots, except that several may
read one readable slot, so calls of a batch may run in any order. ``finish`` takes the orders the
worker reports failed (a full disk, a load that did not verify) or late (a disk read or write
past the worker's deadline): their hashes leave the level, counted as save or verify failures or
deadline misses, and the pool recomputes those blocks. ``abandon`` (a dead session) drops what
the batch was writing.

Policies (``policy``), i.e. when a block reaches the disk level:
  * ``demote`` (default): when a host slot is reused, its hash is written down to disk first if
    it was hit at least ``admit_hits`` times (default 0: every block) and the disk lacks it.
    Disk traffic only for what the host level cannot keep.
  * ``write_through``: every block saved to host memory is written down in the same batch. The
    disk holds everything the host level does, so host eviction copies nothing and a restarted
    node finds every block on disk; it costs one disk write per save.
  * ``write_through_selective``: a block is written down at its ``admit_hits``-th hit in the host
    level (default 2, SGLang HiCache's rule): blocks used once never cost a disk write, the
    reused ones survive host eviction.
Lower-level admission is thus by hit count. Saves from the device always go to host memory (the
fast level); disk blocks come back up by ``prefetch`` (disk -> host), and are loaded to the
device by a later call once landed: the disk read stays off the step's critical path.

Retention (manager/core/retention.py): a pinned hash's slot holds a reference in every level
until the pin ends, within a bounded share of each level; eviction order is priority, then LRU
(node_level.py). Every hash that leaves a level is recorded with why (``take_removals``):
evicted, demoted (it is still in, or being written to, the disk level), cleared (reset),
expired_pin (its pin expired and it was evicted before being used again), failed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.node_admin import MAX_REMOVALS, NodeTierAdmin, Removal
from kvpool.manager.core.node_level import NodeLevel
from kvpool.manager.core.retention import PinInfo, PinRefused, PinTable
from kvpool.shared.node_orders import Load, Order, Save

__all__ = ["POLICIES", "Hit", "NodeTier", "Removal"]

POLICIES = ("demote", "write_through", "write_through_selective")
_DEFAULT_ADMIT = {"demote": 0, "write_through": 0, "write_through_selective": 2}


@dataclass(frozen=True, slots=True)
class Hit:
    """A readable slot holding ``key`` in ``level``."""

    level: str
    slot: int
    key: bytes


@dataclass
class TierBatch:
    """The orders of one batch and the slots it references until it is finished."""

    refs: dict[tuple[str, int], int] = field(default_factory=dict)  # (level, slot) -> references until finish
    orders: list[Order] = field(default_factory=list)

    def ref(self, level: str, slot: int) -> None:
        self.refs[(level, slot)] = self.refs.get((level, slot), 0) + 1


class NodeTier(NodeTierAdmin):
    def __init__(self, host_blocks: int, disk_blocks: int, block_size: int, block_bytes: int,
                 policy: str = "demote", admit_hits: int | None = None, pin_share: float = 0.25,
                 enable_events: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"node tier policy must be one of {POLICIES}, got {policy!r}")
        admit = _DEFAULT_ADMIT[policy] if admit_hits is None else admit_hits
        if admit < 0 or (policy == "write_through" and admit) or (policy == "write_through_selective" and admit < 1):
            raise ValueError(f"admit_hits {admit} does not fit policy {policy}: write_through takes 0, "
                             "write_through_selective 1 or more, demote 0 or more")
        self.policy, self.admit_hits, self.block_size = policy, admit, block_size
        self.host = NodeLevel("host", "CPU", host_blocks, block_bytes, enable_events)
        self.disk = NodeLevel("disk", "DISK", disk_blocks, block_bytes, enable_events) if disk_blocks >= 2 else None
        self.levels = {lv.name: lv for lv in (self.host, self.disk) if lv is not None}
        self.pins = PinTable({n: lv.num_blocks - 1 for n, lv in self.levels.items()}, pin_share)
        self.batches: dict[object, TierBatch] = {}
        self.expired: set[bytes] = set()  # hashes whose pin expired, not used since
        self.removals: deque[Removal] = deque(maxlen=MAX_REMOVALS)
        self.next_batch = 1  # the number of the next batch (batch_key)
        # pools in front of the tier (Pool.set_node counts them; the manager's registry keeps the
        # count exact as pools form and go): with more than one, every block a pool computes is
        # saved after the forward that fills it (``eager``), so the others find it at once
        self.links = 0
        self.engines: set[str] = set()  # sessions of engines that joined (node_join), until they end
        self._cleared: dict[str, list[list[bytes]]] = {n: [] for n in self.levels}
        self._restated = False

    # -- lookups and loads -----------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[Hit]:
        """The longest prefix of ``hashes`` readable in the tier, each from its fastest level
        (no side effects)."""
        hits = []
        for h in hashes:
            for lv in self.levels.values():
                b = lv.readable(h)
                if b is not None:
                    hits.append(Hit(lv.name, b, h))
                    break
            else:
                break
        return hits

    def hold(self, owner: object, hits: Sequence[Hit]) -> None:
        """References ``hits`` for ``owner``'s batch: no save evicts them before its loads.
        Hold before taking the device blocks to load into (that may save into the tier)."""
        batch = self._batch(owner)
        for hit in hits:
            lv = self.levels[hit.level]
            if lv.readable(hit.key) != hit.slot:
                raise InvariantBroken(f"{hit.level} slot {hit.slot} no longer holds the hit's hash readable")
            lv.ref(hit.slot)
            batch.ref(hit.level, hit.slot)

    def load(self, owner: object, hits: Sequence[Hit], device_blocks: Sequence[int], priority: int = 0) -> list[Order]:
        """Host -> device loads of held host ``hits`` (and, under write_through_selective, the
        write-downs their hits earn)."""
        if len(hits) != len(device_blocks):
            raise ValueError(f"{len(hits)} hits to load into {len(device_blocks)} device blocks")
        batch, host, out = self._batch(owner), self.host, []
        for hit, d in zip(hits, device_blocks):
            if hit.level != "host" or (hit.level, hit.slot) not in batch.refs:
                raise InvariantBroken(f"{hit.level} slot {hit.slot} loaded to the device without a hold")
            out.append(Load("host", hit.slot, d, hit.key))
            host.seen(hit.slot, priority, hit=True)
            host.stats.loads += 1
            self.expired.discard(hit.key)
            if self.policy == "write_through_selective" and host.hits[hit.slot] == self.admit_hits:
                self._write_down(batch, hit.slot, hit.key, host.prio[hit.slot], out)
        batch.orders += out
        return out

    def prefetch(self, owner: object, hits: Sequence[Hit], priority: int = 0) -> list[Order]:
        """Disk -> host loads of disk ``hits`` (held here); the blocks are readable in host
        memory once the batch finishes. A hash host memory holds already is skipped."""
        batch, host, out = self._batch(owner), self.host, []
        disk_hits = [hit for hit in hits if hit.level == "disk"]
        self.hold(owner, disk_hits)
        for hit in disk_hits:
            if host.holds(hit.key):
                continue
            dst = self._place(batch, host, hit.key, None, priority, out)
            if dst is None:
                continue
            out.append(Load("disk", hit.slot, dst, hit.key))
            self.disk.seen(hit.slot, priority, hit=True)  # type: ignore[union-attr]
            self.disk.stats.loads += 1  # type: ignore[union-attr]
            self.expired.discard(hit.key)
        batch.orders += out
        return out

    # -- saves -----------------------------------------------------------------------------

    def save(self, owner: object, device_block: int, h: bytes, parent: bytes | None, priority: int = 0,
             source: str = "device") -> list[Order]:
        """Orders saving the pool's ``device_block`` (holding ``h``; with ``source="private"``
        its private host tier's block) to host memory: nothing when the tier holds ``h`` in
        host memory already or every host slot is referenced; a victim's write-down first
        (demote), the block's own write-down after (write_through)."""
        host, out = self.host, []
        held = host.blocks.cached.get(h)
        if held is not None:
            host.seen(held, priority, hit=False)
            host.stats.saves_skipped += 1
            self.expired.discard(h)
            return out
        batch = self._batch(owner)
        dst = self._place(batch, host, h, parent, priority, out)
        if dst is not None:
            out.append(Save("host", device_block, dst, h, source))
            if self.policy == "write_through":
                self._write_down(batch, dst, h, priority, out)
        batch.orders += out
        return out

    def _write_down(self, batch: TierBatch, slot: int, h: bytes, priority: int, out: list[Order]) -> None:
        """host ``slot`` (referenced by ``batch``) -> a disk slot, unless the disk holds ``h``."""
        disk = self.disk
        if disk is None:
            return
        if disk.holds(h):
            disk.stats.saves_skipped += 1
            return
        q = self._place(batch, disk, h, None, priority, out)
        if q is not None:
            out.append(Save("disk", slot, q, h))

    def _place(self, batch: TierBatch, lv: NodeLevel, h: bytes, parent: bytes | None, priority: int,
               out: list[Order]) -> int | None:
        """A slot of ``lv`` for ``h``, landing and referenced by ``batch``; the write-down of
        the hash it held, when the policy keeps that, goes into ``out`` first."""
        taken = lv.take(h, parent, priority)
        if taken is None:
            return None
        b, victim = taken
        batch.ref(lv.name, b)
        lv.landing[b] = batch
        if victim is not None:
            demoted = False
            if lv is self.host and self.disk is not None:
                if self.policy == "demote" and victim.hits >= self.admit_hits:
                    self._write_down(batch, b, victim.key, victim.priority, out)
                demoted = self.disk.holds(victim.key)
            self._removed(lv, victim.key, "demoted" if demoted else "evicted")
        if self.pins.is_pinned(h):
            lv.retain(b)
        return b

    # -- batches ---------------------------------------------------------------------------

    @property
    def eager(self) -> bool:
        """Whether pools save each block they compute right after its forward pass: only while
        the tier is shared. A pool alone moves its blocks down as its own tiers hand them out
        (manager/core/pool_node.py): on one pool an eager copy mostly duplicates what the device
        and the private host tier hold (README, *The node tier*, measured)."""
        return self.links + len(self.engines) > 1

    def set_links(self, n: int) -> None:
        """The registry's count of the formed pools in front of the tier."""
        self.links = n

    def join_engine(self, sid: str) -> None:
        """An engine that owns its device blocks (vLLM's connector) shares the tier while its
        session lasts: a pool beside it saves what it computes at once, so the engine finds it."""
        self.engines.add(sid)

    def leave_engine(self, sid: str) -> None:
        self.engines.discard(sid)

    def batch_key(self, owner: object) -> tuple[object, int]:
        """The key of a new batch of ``owner`` (a session, a pool): ``(owner, number)``, the
        number the tier's own, so no two batches of one tier share one whatever a client
        numbers its steps (a client that reuses step ids never merges two batches)."""
        n, self.next_batch = self.next_batch, self.next_batch + 1
        return owner, n

    def _batch(self, owner: object) -> TierBatch:
        batch = self.batches.get(owner)
        if batch is None:
            batch = self.batches[owner] = TierBatch()
        return batch

    def finish(self, owner: object, failed: Sequence[Order] = (), late: Sequence[Order] = ()) -> None:
        """``owner``'s orders ran; those in ``failed`` did not (a save that did not land, a load
        that did not verify) and those in ``late`` (disk reads and writes) missed the worker's
        deadline: their hashes leave the tier either way (a slot an I/O hung on is not tried
        again), counted apart. Its references end and what it wrote becomes readable."""
        batch = self.batches.get(owner)
        if batch is None:
            if failed or late:
                raise ValueError(f"failed orders reported for {owner!r}, which has no batch")
            return
        for order in (*failed, *late):  # checked before anything changes
            if order not in batch.orders:
                raise ValueError(f"{order} is not an order of {owner!r}'s batch")
        del self.batches[owner]
        for order in late:  # first: a host load behind a late prefetch is that prefetch's failure
            self._failed(order, late=True)
        for order in failed:
            self._failed(order)
        self._release(batch)

    def abandon(self, owner: object) -> None:
        """``owner`` is gone (a dead session) with its copies in an unknown state: every slot
        its batch was writing loses its hash, and its references end."""
        batch = self.batches.pop(owner, None)
        if batch is None:
            return
        for name, b in batch.refs:
            lv = self.levels[name]
            if lv.landing.get(b) is batch:
                self._removed(lv, lv.drop(b), "failed")
        self._release(batch)

    def withdraw(self, owner: object, orders: Sequence[Order]) -> None:
        """Saves of ``owner``'s batch that must not run (their source changed before they
        could): their slots lose the hash now, and the orders leave the batch."""
        batch = self.batches[owner]
        for order in orders:
            if isinstance(order, Save):
                lv = self.levels[order.to]
                if lv.landing.get(order.dst) is batch:
                    self._drop_if(lv, order.dst, order.key)
            batch.orders.remove(order)

    def close_if_empty(self, owner: object) -> None:
        """Ends ``owner``'s batch at once when it ordered nothing (no worker reports it)."""
        batch = self.batches.get(owner)
        if batch is not None and not batch.orders:
            del self.batches[owner]
            self._release(batch)

    def _failed(self, order: Order, late: bool = False) -> None:
        if isinstance(order, Save):
            lv = self.levels[order.to]
            if late:
                lv.stats.deadline_misses += 1
            else:
                lv.stats.save_failures += 1
            self._drop_if(lv, order.dst, order.key)
        else:
            lv = self.levels[order.frm]
            if late:
                lv.stats.deadline_misses += 1
            elif lv.blocks.block_hash[order.src] == order.key:  # else: its prefetch failed (counted there)
                lv.stats.verify_failures += 1
            self._drop_if(lv, order.src, order.key)
            if order.frm == "disk":
                self._drop_if(self.host, order.dst, order.key)

    def _drop_if(self, lv: NodeLevel, b: int, key: bytes) -> None:
        if lv.blocks.block_hash[b] == key:
            self._removed(lv, lv.drop(b), "failed")

    def _release(self, batch: TierBatch) -> None:
        for (name, b), n in batch.refs.items():
            lv = self.levels[name]
            if lv.landing.get(b) is batch:
                del lv.landing[b]
            for _ in range(n):
                lv.unref(b)

    # -- retention -------------------------------------------------------------------------

    def pin(self, hashes: Sequence[bytes], ttl_s: float, now: float) -> int | PinRefused:
        """Pins a prefix's hash chain for ``ttl_s`` seconds from ``now``: its id, or PinRefused
        (over the pinned share of a level; nothing changed)."""
        got = self.pins.add(hashes, ttl_s, now)
        if isinstance(got, PinRefused):
            return got
        pin_id, new = got
        for h in new:
            self.expired.discard(h)
            for lv in self.levels.values():
                b = lv.blocks.cached.get(h)
                if b is not None:
                    lv.retain(b)
        return pin_id

    def unpin(self, pin_id: int, expired: bool = False) -> bool:
        """Ends a pin (``expired``: its time ran out; a later removal of its hashes says so)."""
        released = self.pins.remove(pin_id)
        if released is None:
            return False
        self._unretain(released, expired=expired)
        return True

    def expire(self, now: float) -> list[int]:
        """Ends the pins whose time is up at ``now``; their ids."""
        ids = self.pins.expired(now)
        for pin_id in ids:
            self._unretain(self.pins.remove(pin_id) or [], expired=True)
        return ids

    def _unretain(self, hashes: list[bytes], expired: bool) -> None:
        for h in hashes:
            for lv in self.levels.values():
                b = lv.blocks.cached.get(h)
                if b is not None:
                    lv.release(b)
                    if expired:
                        self.expired.add(h)

    def list_pins(self, now: float) -> list[PinInfo]:
        return self.pins.listing(now)
