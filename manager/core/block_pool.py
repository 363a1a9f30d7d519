"""The block pool: ref counts, the free queue and the ``block_hash -> block`` prefix-cache map.

Pure Python, no I/O. Block ids are ints in ``[0, num_blocks)``; block 0 is the null block,
never allocated, freed or cached (block tables pad with it). Per-block state lives in parallel
lists (``ref_cnt``, ``block_hash``) rather than objects: this is the hot path of the manager.

Its per-block loops stay plain loops on purpose. CPython 3.11 specializes their list and dict
subscripts, and every batching in C builtins tried so far executed more instructions on the
reference trace (valgrind, 5,000 requests, GC off; scripts/count_pool_work.py counts the
bytecodes): ``itemgetter`` reads of refs and hashes with ``compress`` in free_blocks, +10% for
the pool; ``dict.keys().isdisjoint`` checks instead of a membership test per block in the
allocation path, +5% for 81 fewer bytecodes; one ``list.extend`` per free with tombstones for
the blocks that do not join the LRU segment, +4%.

Invariants (``check_invariants`` verifies them; DESIGN.md numbers them):
  2. every block but 0 is either free (in the queue, ref 0) or in use (out of it, ref > 0);
  4. every map entry ``h -> b`` has ``block_hash[b] == h``; duplicates (same hash, several
     blocks) are kept in ``_dups`` and every hashed block is in the map or in ``_dups``;
  6. eviction is lazy: a freed hashed block keeps its entry until it is handed out again;
  7. free-queue order (see free_queue.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvpool.manager.core.bulk import pieces
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
        return list(map(self.ref_cnt.__getitem__, blocks)).count(0)

    def duplicates(self) -> dict[bytes, list[int]]:
        """Hash -> the blocks holding it besides its map entry (read-only: the snapshot codec)."""
        return self._dups

    @classmethod
    def restore(cls, ref_cnt: list[int], block_hash: list[bytes | None], primary: list[int],
                dups: dict[bytes, list[int]], free_queue: FreeQueue, num_evictions: int, *,
                enable_caching: bool, enable_events: bool) -> BlockPool:
        """A block pool from its parts (manager/core/snapshot.py decodes them); the caller
        checks the invariants before using it."""
        bp = cls(2, enable_caching, enable_events)  # placeholder parts (not 1M-entry ones), replaced below
        bp.num_blocks = len(ref_cnt)
        bp.ref_cnt, bp.block_hash, bp._dups, bp.free_queue = ref_cnt, block_hash, dups, free_queue
        free_queue.reserve(len(ref_cnt))
        for part in pieces(primary):  # in pieces: see manager/core/bulk.py
            bp.cached.update(zip(map(block_hash.__getitem__, part), part))  # type: ignore[arg-type]
        bp.num_evictions = num_evictions
        return bp

    # -- events ----------------------------------------------------------------------------

    @property
    def events_enabled(self) -> bool:
        return self._events is not None

    def set_events(self, enabled: bool) -> None:
        """Turns event queuing on (from an empty queue) or off (what is queued is dropped): the
        owner decides whether anything could ever receive them (a daemon without a subscriber
        socket builds none, whatever state the pool was restored from)."""
        if enabled != self.events_enabled:
            self._events = [] if enabled else None

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
        ref, remove = self.ref_cnt, self.free_queue.remove
        for b in blocks:
            if ref[b] == 0:
                remove(b)
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """``n`` blocks with ref 1, unhashed ones first, then evicting the LRU cached ones.

        The caller checks ``n <= num_free`` first (allocations are all-or-nothing).
        """
        ref = self.ref_cnt
        blocks, evicted = self.free_queue.pop(n)
        for b in blocks:
            ref[b] = 1
        if evicted:
            if self.on_reuse is not None:
                bhash, on_reuse = self.block_hash, self.on_reuse
                for b in evicted:
                    on_reuse(b, bhash[b])  # type: ignore[arg-type]
            self._drop_hashes(evicted, new_ref=1)
            blocks += evicted
        return blocks

    def get_cached_blocks(self, n: int, hashes: Sequence[bytes], parent: bytes | None) -> list[int]:
        """``get_new_blocks(n)`` then ``cache_fresh`` of ``hashes`` on the first of them: the
        allocation path. Without events, evicted blocks lose their old hash and take the new
        one in two loops instead of three (every old hash leaves the map before a new one
        enters, as in the unfused calls)."""
        if self._events is not None or not self.enable_caching or not hashes:
            blocks = self.get_new_blocks(n)
            self.cache_fresh(blocks, hashes, parent)
            return blocks
        ref, bhash, cached, dups = self.ref_cnt, self.block_hash, self.cached, self._dups
        blocks, evicted = self.free_queue.pop(n)
        for b in blocks:
            ref[b] = 1
        if evicted:
            if self.on_reuse is not None:
                on_reuse = self.on_reuse
                for b in evicted:
                    on_reuse(b, bhash[b])  # type: ignore[arg-type]
            self.num_evictions += len(evicted)
            for b in evicted:
                ref[b] = 1
                h = bhash[b]
                if h in dups:
                    bhash[b] = None
                    self._drop_shared(b, h)  # type: ignore[arg-type]
                else:  # b is h's only holder, so cached[h] == b (invariant 4)
                    del cached[h]  # type: ignore[arg-type]
            blocks += evicted
        self.cache_fresh(blocks, hashes, parent)  # events are off here: the map entries alone
        if len(blocks) > len(hashes):  # evicted blocks past the hashes still hold their old one
            for b in blocks[max(len(hashes), len(blocks) - len(evicted)) :]:
                bhash[b] = None
        return blocks

    def free_blocks(self, blocks_tail_first: Iterable[int]) -> None:
        """Drops one reference on each block; blocks reaching 0 join the free queue.

        Callers pass a request's blocks tail-first so a hash chain is evicted from its end.
        Unhashed blocks go to the front in the order given (tail first, reused first), as
        vLLM 0.33's ``free_blocks`` prepends them; hashed ones to the back.
        """
        ref, bhash = self.ref_cnt, self.block_hash
        push_back, pos, k = self.free_queue.releaser()
        unhashed: list[int] = []
        for b in blocks_tail_first:
            if ref[b] == 1:  # the common case, in fewer steps than ``ref[b] -= 1`` and a test
                ref[b] = 0
                if bhash[b] is None:
                    unhashed.append(b)
                else:
                    pos[b] = k
                    k += 1
                    push_back(b)
            else:
                ref[b] -= 1
        if unhashed:
            self.free_queue.prepend(unhashed)

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[bytes], parent: bytes | None) -> None:
        """Records the hashes of blocks that became full (``parent`` precedes hashes[0]); blocks
        that already hold one (prefix-cache hits) are skipped. The extend path: usually one block."""
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

    def cache_fresh(self, blocks: Sequence[int], hashes: Sequence[bytes], parent: bytes | None) -> None:
        """``cache_blocks`` for blocks known to hold no hash (just handed out): the allocation
        path, which skips the per-block check. Pairs go by ``zip``: extra blocks stay unhashed."""
        if not self.enable_caching:
            return
        bhash, cached, dups = self.block_hash, self.cached, self._dups
        for b, h in zip(blocks, hashes):
            bhash[b] = h
            if h in cached:
                dups.setdefault(h, []).append(b)
            else:
                cached[h] = b
        if self._events is not None:
            # the hashes that became map entries here, in order (a duplicate's entry is another block)
            stored = [h for b, h in zip(blocks, hashes) if cached[h] == b]
            if stored:
                self._events.append(BlockStored(stored, parent))

    def uncache(self, block: int) -> None:
        """Drops the hash of one in-use ``block`` (its ref count stays): the host tier withdraws
        a write-through whose source was reused (manager/core/host_tier.py)."""
        if self.block_hash[block] is None or self.ref_cnt[block] == 0:
            raise InvariantBroken(f"uncache of block {block}: it must be in use and hashed")
        self._drop_hashes([block], new_ref=self.ref_cnt[block])
        self.num_evictions -= 1  # a withdrawal, not an eviction

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
            if dups:  # the oldest other holder, as vLLM's map (a dict in insertion order) gives
                self.cached[h] = dups.pop(0)
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
