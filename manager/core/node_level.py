"""One level of the node tier (shared host memory, or disk): its blocks and eviction order.

Pure Python, no I/O. A level is a ``BlockPool`` (ref counts, free queue, ``hash -> slot`` map,
its invariants and KV events; slot ids are the store's slot numbers, 0 the null slot) plus what
the node tier adds on top:

  * a slot is referenced (ref > 0) only by the batches of orders that read or write it, until
    each batch is finished (``NodeTier.finish``), and by a retention pin on its hash (one
    reference however many pins name it); otherwise it is free;
  * a slot written by a batch is *landing* until that batch finishes: its hash is in the map
    (so no other batch saves it twice) but no lookup returns it, since its bytes may not be
    there yet;
  * eviction takes the least important priority class first, then LRU within the class.
    Priorities follow vLLM's request ``priority`` (lower values are handled first, so they are
    the more important): the victim is the least recently used free slot of the *largest*
    value present. A slot's priority is the most important one among the requests that saved
    or hit it since it took its hash, so a prefix an important request uses is not lost to a
    flood of unimportant ones. The per-class order is kept beside the free queue (``classes``:
    one insertion-ordered dict per value, in the free queue's own LRU order); the victim leaves
    the queue by ``touch`` and loses its hash by ``uncache``, so the pool's maps and events stay
    the only ones;
  * no duplicates: the tier never saves a hash a level holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.manager.core.block_pool import BlockPool, InvariantBroken

REASONS = ("evicted", "demoted", "cleared", "expired_pin", "failed")


@dataclass(frozen=True, slots=True)
class Victim:
    """The hash a slot held before it was taken for another."""

    key: bytes
    priority: int
    hits: int


@dataclass
class LevelStats:
    hits: int = 0  # blocks served from this level (loads to the device, or prefetches up)
    saves: int = 0  # blocks written into this level
    saves_skipped: int = 0  # saves of a hash the level held already
    saves_dropped: int = 0  # saves with every slot referenced: the hash is not kept here
    save_failures: int = 0  # saves the worker reported failed (a full disk, an I/O error)
    loads: int = 0  # orders reading this level
    verify_failures: int = 0  # loads whose bytes did not verify (recomputed, never served)
    deadline_misses: int = 0  # disk reads (recomputed) and writes past the worker's deadline
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


class NodeLevel:
    def __init__(self, name: str, medium: str, num_blocks: int, block_bytes: int,
                 enable_events: bool = False) -> None:
        self.name = name
        self.medium = medium  # the KV events' medium
        self.block_bytes = block_bytes
        self.blocks = BlockPool(num_blocks, True, enable_events)
        self.prio: list[int] = [0] * num_blocks
        self.hits: list[int] = [0] * num_blocks
        self.classes: dict[int, dict[int, None]] = {}  # priority -> free hashed slots, LRU first
        self.retained: set[int] = set()
        self.landing: dict[int, object] = {}  # slot -> the batch whose save writes it
        self.stats = LevelStats()

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def holds(self, h: bytes) -> bool:
        return h in self.blocks.cached

    def readable(self, h: bytes) -> int | None:
        """The slot holding ``h`` whose bytes have landed, or None."""
        b = self.blocks.cached.get(h)
        return None if b is None or b in self.landing else b

    # -- references ------------------------------------------------------------------------

    def ref(self, b: int) -> None:
        """One more reference on slot ``b`` (a batch's pin or a retention)."""
        if self.blocks.ref_cnt[b] == 0 and self.blocks.block_hash[b] is not None:
            del self.classes[self.prio[b]][b]
        self.blocks.touch((b,))

    def unref(self, b: int) -> None:
        bp = self.blocks
        bp.free_blocks((b,))
        if bp.ref_cnt[b] == 0 and bp.block_hash[b] is not None:
            self.classes.setdefault(self.prio[b], {})[b] = None

    def retain(self, b: int) -> None:
        if b not in self.retained:
            self.retained.add(b)
            self.ref(b)

    def release(self, b: int) -> None:
        if b in self.retained:
            self.retained.discard(b)
            self.unref(b)

    def seen(self, b: int, priority: int, hit: bool) -> None:
        """``b``'s hash was asked for again: the more important priority sticks; a free slot
        becomes the most recently used of its class."""
        free = self.blocks.ref_cnt[b] == 0
        if free:
            self.ref(b)
        self.prio[b] = min(self.prio[b], priority)
        if hit:
            self.hits[b] += 1
            self.stats.hits += 1
        if free:
            self.unref(b)

    # -- taking and dropping ---------------------------------------------------------------

    def take(self, h: bytes, parent: bytes | None, priority: int) -> tuple[int, Victim | None] | None:
        """A slot now holding ``h`` with one reference (the caller's batch pin) and the hash it
        lost, if it held one; None when every slot is referenced."""
        bp = self.blocks
        if bp.num_free == 0:
            self.stats.saves_dropped += 1
            return None
        victim = None
        if bp.num_free > bp.free_queue.num_hashed():  # an unhashed slot: nothing lost
            (b,) = bp.get_new_blocks(1)
        else:
            b = self._victim()
            victim = Victim(bp.block_hash[b], self.prio[b], self.hits[b])  # type: ignore[arg-type]
            bp.touch((b,))
            bp.uncache(b)
        bp.cache_blocks((b,), (h,), parent)
        self.prio[b], self.hits[b] = priority, 0
        self.stats.saves += 1
        return b, victim

    def _victim(self) -> int:
        """The free hashed slot to reuse: the LRU one of the least important class."""
        worst = max(p for p, slots in self.classes.items() if slots)
        slots = self.classes[worst]
        b = next(iter(slots))
        del slots[b]
        if not slots:
            del self.classes[worst]
        return b

    def drop(self, b: int) -> bytes:
        """Slot ``b`` (referenced) loses its hash now; returns it."""
        h = self.blocks.block_hash[b]
        self.blocks.uncache(b)  # first: it needs the reference a retention may hold
        self.release(b)
        self.landing.pop(b, None)
        return h  # type: ignore[return-value]

    def evict_one(self) -> bytes | None:
        """Drops the hash of the next victim (admin evict); None when no free slot holds one."""
        if not any(self.classes.values()):
            return None
        b = self._victim()
        h = self.blocks.block_hash[b]
        self.blocks.touch((b,))
        self.blocks.uncache(b)
        self.blocks.free_blocks((b,))  # unhashed now: to the front
        return h

    def clear(self) -> list[bytes] | None:
        """Forgets every hash (the pins stay and apply again when their hashes come back);
        refused (None) while a batch references a slot."""
        bp = self.blocks
        if bp.num_used > len(self.retained):
            return None
        for b in list(self.retained):
            self.release(b)
        hashes = list(bp.cached)
        bp.reset_prefix_cache()
        self.classes.clear()
        return hashes

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self, batch_refs: dict[int, int], pinned: set[bytes] | frozenset, limit: int) -> None:
        bp = self.blocks
        bp.check_invariants()
        if bp.duplicates():
            raise InvariantBroken(f"{self.name}: a hash held twice")
        order = [b for b in bp.free_queue.order() if bp.block_hash[b] is not None]
        for p, slots in self.classes.items():
            if [b for b in order if self.prio[b] == p] != list(slots):
                raise InvariantBroken(f"{self.name}: priority class {p} out of the free queue's LRU order")
        if sum(map(len, self.classes.values())) != len(order):
            raise InvariantBroken(f"{self.name}: a free hashed slot outside its priority class")
        for b in range(1, bp.num_blocks):
            want = batch_refs.get(b, 0) + (b in self.retained)
            if bp.ref_cnt[b] != want:
                raise InvariantBroken(f"{self.name} slot {b}: ref_cnt {bp.ref_cnt[b]}, want {want}")
            h = bp.block_hash[b]
            if (h is not None and h in pinned) != (b in self.retained):
                raise InvariantBroken(f"{self.name} slot {b}: retained={b in self.retained} but hash pinned={h in pinned}")
        for b in self.landing:
            if bp.block_hash[b] is None or not batch_refs.get(b):
                raise InvariantBroken(f"{self.name} slot {b} landing but unhashed or unreferenced")
        if len(self.retained) > limit:
            raise InvariantBroken(f"{self.name}: {len(self.retained)} slots retained, over the limit {limit}")
