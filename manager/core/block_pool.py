"""The block pool: ref counts, the free queue and the ``block_hash -> block`` prefix-cache map.

Pure Python, no I/O. Block ids are ints in ``[0, num_blocks)``; block 0 is the null block,
never allocated, freed or cached (block tables pad with it). Per-block state lives in parallel
lists (``ref_cnt``, ``block_hash``) rather than objects: this is the hot path of the manager.

Invariants (``check_invariants`` verifies them; DESIGN.md numbers them):
  2. every block but 0 is either free (in the queue, ref 0) or in use (out of it, ref > 0);
  4. every map entry ``h -> b`` has ``block_hash[b] == h``; duplicates (same hash, several
     blocks) are kept in ``_dups`` and every hashed block is in the map or in ``_dups``;
  6. eviction is lazy: a freed hashed block keeps its entry until it is handed out again;
  7. free-queue order (see free_queue.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvpool.manager.core.free_queue import FreeQueue
from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

NULL_BLOCK = 0


class InvariantBroken(AssertionError):
    """A pool invariant does not hold: a manager bug, or a corrupt state being loaded.

    Raised by explicit checks, never by ``assert`` (``python -O`` removes those); it subclasses
    AssertionError only so that callers written against the old asserts still catch it.
    """


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue = FreeQueue(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}
        self._dups: dict[bytes, list[int]] = {}
        self._events: list[KVEvent] | None = [] if enable_events else None  # see take_events
        self.num_evictions = 0
        # Called with (block, hash) for each cached block handed out again, before its hash is
        # dropped: the pool's host tier saves it there (manager/core/host_tier.py).
        self.on_reuse: Callable[[int, bytes], None] | None = None

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of a hash chain (no side effects)."""
        cached = self.cached
        hits: list[int] = []
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_reclaimable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them shrinks it)."""
        ref = self.ref_cnt
        return sum(1 for b in blocks if ref[b] == 0)

    def duplicates(self) -> dict[bytes, list[int]]:
        """Hash -> the blocks holding it besides its map entry (read-only: the snapshot codec)."""
        return self._dups

    @classmethod
    def restore(cls, ref_cnt: list[int], block_hash: list[bytes | None], primary: list[int],
                dups: dict[bytes, list[int]], free_queue: FreeQueue, num_evictions: int, *,
                enable_caching: bool, enable_events: bool) -> BlockPool:
        """A block pool from its parts (manager/core/snapshot.py decodes them); the caller
        checks the invariants before using it."""
        bp = cls(len(ref_cnt), enable_caching, enable_events)
        bp.ref_cnt, bp.block_hash, bp._dups, bp.free_queue = ref_cnt, block_hash, dups, free_queue
        bp.cached = dict(zip(map(block_hash.__getitem__, primary), primary))  # type: ignore[arg-type]
        bp.num_evictions = num_evictions
        return bp

    # -- events ----------------------------------------------------------------------------

    @property
    def events_enabled(self) -> bool:
        return self._events is not None

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last call, oldest first (none when events are off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def restate_events(self) -> None:
        """Replaces the queued events with a clear and one store of every cached hash, so a
        subscriber matches this cache whatever it saw before (a restarted or recovered pool)."""
        if self._events is None:
            return
        cached = list(self.cached)
        self._events = [AllBlocksCleared(), *([BlockStored(cached, None)] if cached else [])]

    # -- mutations -------------------------------------------------------------------------

    def touch(self, blocks: Sequence[int]) -> None:
        """Takes a reference on each block, reviving free (cached) ones out of the queue."""
        ref = self.ref_cnt
        for b in blocks:
            if ref[b] == 0:
                self.free_queue.remove(b)
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """``n`` blocks with ref 1, unhashed ones first, then evicting the LRU cached ones.

        The caller checks ``n <= num_free`` first (allocations are all-or-nothing).
        """
        fq, ref = self.free_queue, self.ref_cnt
        blocks = fq.pop_unhashed(n)
        for b in blocks:
            ref[b] = 1
        if len(blocks) < n:
            evicted = fq.pop_hashed(n - len(blocks))
            if self.on_reuse is not None:
                bhash, on_reuse = self.block_hash, self.on_reuse
                for b in evicted:
                    on_reuse(b, bhash[b])  # type: ignore[arg-type]
            self._drop_hashes(evicted, new_ref=1)
            blocks += evicted
        return blocks

    def free_blocks(self, blocks_tail_first: Iterable[int]) -> None:
        """Drops one reference on each block; blocks reaching 0 join the free queue.

        Callers pass a request's blocks tail-first so a hash chain is evicted from its end.
        """
        ref, bhash = self.ref_cnt, self.block_hash
        push_front, lru = self.free_queue.releaser()
        for b in blocks_tail_first:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if bhash[b] is None:
                    push_front(b)
                else:
                    lru[b] = None  # a subscript store: cheaper than calling lru.__setitem__

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[bytes], parent: bytes | None) -> None:
        """Records the hashes of blocks that became full (``parent`` precedes hashes[0])."""
        if not self.enable_caching:
            return
        bhash, cached, events = self.block_hash, self.cached, self._events
        stored: list[bytes] = []  # for the event only
        for b, h in zip(blocks, hashes):
            if bhash[b] is not None:
                continue  # a prefix-cache hit: already recorded
            bhash[b] = h
            if h in cached:
                self._dups.setdefault(h, []).append(b)
            else:
                cached[h] = b
                if events is not None:
                    stored.append(h)
        if stored:
            events.append(BlockStored(stored, parent))  # type: ignore[union-attr]

    def evict(self, n: int) -> int:
        """Drops the hashes of up to ``n`` free cached blocks, LRU first; returns how many."""
        fq = self.free_queue
        evicted = fq.pop_hashed(min(n, fq.num_hashed()))
        self._drop_hashes(evicted)
        for b in evicted:
            fq.move_to_front(b)
        return len(evicted)

    def reset_prefix_cache(self) -> bool:
        """Forgets every hash; refused (False) while any block is in use."""
        if self.num_used:
            return False
        for b in self.free_queue.clear_hashes():
            self.block_hash[b] = None
        self.cached.clear()
        self._dups.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def _drop_hashes(self, blocks: list[int], new_ref: int = 0) -> None:
        """Lazy eviction: blocks leaving the free queue for reuse lose their hash and get
        ``new_ref`` (1: handed out now; 0: they stay free)."""
        bhash, cached, dups, events, ref = self.block_hash, self.cached, self._dups, self._events, self.ref_cnt
        for b in blocks:
            ref[b] = new_ref
            h = bhash[b]
            bhash[b] = None
            if h in dups:  # else b is h's only holder, so cached[h] == b (invariant 4)
                self._drop_shared(b, h)  # type: ignore[arg-type]
                continue
            del cached[h]  # type: ignore[arg-type]
            if events is not None:
                events.append(BlockRemoved([h]))
        self.num_evictions += len(blocks)

    def _drop_shared(self, b: int, h: bytes) -> None:
        """The slow path: ``h`` may have duplicates, or ``b`` may be one of them."""
        dups = self._dups.get(h)
        if self.cached[h] == b:
            if dups:
                self.cached[h] = dups.pop()
            else:
                del self.cached[h]
                if self._events is not None:
                    self._events.append(BlockRemoved([h]))
        else:
            dups.remove(b)  # type: ignore[union-attr]
        if dups is not None and not dups:
            del self._dups[h]

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises InvariantBroken naming the first broken invariant (explicit checks: they hold
        under ``python -O`` too)."""
        if self.ref_cnt[NULL_BLOCK] != 0 or self.block_hash[NULL_BLOCK] is not None:
            raise InvariantBroken("null block touched")
        order = self.free_queue.order()
        in_queue = set(order)
        if len(in_queue) != len(order):
            raise InvariantBroken("a block is twice in the free queue")
        if NULL_BLOCK in in_queue:
            raise InvariantBroken("null block in the free queue")
        for b in range(1, self.num_blocks):
            r = self.ref_cnt[b]
            if r < 0:
                raise InvariantBroken(f"block {b} has ref_cnt {r}")
            if (r == 0) != (b in in_queue):
                raise InvariantBroken(f"block {b}: ref_cnt {r} but in_queue={b in in_queue}")
        seen_hashed = False
        for b in order:
            if self.block_hash[b] is None:
                if seen_hashed:
                    raise InvariantBroken(f"unhashed block {b} queued behind a hashed one")
            else:
                seen_hashed = True
        holders: dict[bytes, list[int]] = {}
        for b in range(1, self.num_blocks):
            h = self.block_hash[b]
            if h is not None:
                holders.setdefault(h, []).append(b)
        if set(holders) != set(self.cached):
            raise InvariantBroken("hash map and block hashes disagree")
        for h, bs in holders.items():
            if self.cached[h] not in bs:
                raise InvariantBroken(f"map entry for {h.hex()[:8]} points at a block without it")
            if sorted(bs) != sorted([self.cached[h], *self._dups.get(h, [])]):
                raise InvariantBroken("duplicates untracked")
