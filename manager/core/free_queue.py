"""The free-block queue: O(1) pop from the front, push to either end, removal from the middle.

Logically one queue, ``[unhashed blocks ... | hashed blocks in LRU order ...]``, popped from the
front (DESIGN invariant 7). Blocks without a hash have no value and are pushed to the front;
blocks with a hash are pushed to the back, so the least recently freed cached block is evicted
first. Only hashed blocks are ever removed from the middle (a prefix-cache hit revives them).

It is stored as two segments, which keeps every operation O(1) and the bulk ones in C:
- ``_front``: a list used as a stack whose top is the queue's front (unhashed blocks);
- ``_lru``: a list of hashed blocks, oldest first, consumed from index ``_head``. A removal
  leaves a tombstone (0, the null block, which is never queued) found through ``_pos`` (block ->
  its absolute position, ``_base`` + index), so a pop is one slice, plus a filter only when
  tombstones are about. The consumed head is cut off in one memmove once it is half the list.
The queue stays ``front + lru`` because a block never gains a hash while it is free, and the
only operations that drop hashes of free blocks (evict, reset) move those blocks to the front.

Why not an OrderedDict (which it was): each insert allocates a linked node and each delete
frees one. With the list, an eviction is a slice, and lookup+allocate on the reference trace
took about 1/1.2 of the CPU (``bench_pool.py --against``, with the fused allocation in
block_pool.py); the free path, an append plus a position store, costs about the same as before.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.manager.core.bulk import bulk_max, bulk_min, bulk_store

_TOMB = 0  # the null block: never queued, so it marks a removed entry
_COMPACT_MIN = 1024  # the consumed head is cut off past this many entries (and half the list)


class FreeQueue:
    __slots__ = ("_front", "_lru", "_pos", "_base", "_head", "_tombs")

    def __init__(self, block_ids: range | list[int]) -> None:
        # Pop order is the given order: block_ids[0] comes out first.
        self._front: list[int] = list(reversed(block_ids))
        self._lru: list[int] = []
        self._pos: list[int] = [0] * (max(block_ids, default=0) + 1)
        self._base = 0  # absolute position of _lru[0]
        self._head = 0  # index in _lru of the oldest entry not yet popped
        self._tombs = 0  # removed entries at or after _head

    def __len__(self) -> int:
        return len(self._front) + len(self._lru) - self._head - self._tombs

    def num_hashed(self) -> int:
        return len(self._lru) - self._head - self._tombs

    def reserve(self, num_blocks: int) -> None:
        """Makes room for block ids below ``num_blocks`` (a queue restored from segments may
        not name the highest ids, which are in use)."""
        if num_blocks > len(self._pos):
            self._pos.extend([0] * (num_blocks - len(self._pos)))

    def remove(self, block_id: int) -> None:
        """Takes a hashed free block out of the middle (a prefix-cache hit)."""
        i = self._pos[block_id] - self._base
        if not self._head <= i < len(self._lru) or self._lru[i] != block_id:
            raise KeyError(block_id)  # not a queued hashed block: a caller's bug
        self._lru[i] = _TOMB
        self._tombs += 1

    def pop(self, n: int) -> tuple[list[int], list[int]]:
        """``n`` blocks from the front (``n <= len(self)``): the unhashed ones, then the hashed
        ones (the caller drops their hashes). One call for the allocation path."""
        front = self._front
        k = min(n, len(front))
        if k:
            unhashed = front[-k:]
            del front[-k:]
            unhashed.reverse()
        else:
            unhashed = []
        return unhashed, (self.pop_hashed(n - k) if k < n else [])

    def pop_hashed(self, n: int) -> list[int]:
        """The ``n`` least recently freed hashed blocks (the caller drops their hashes;
        ``n <= num_hashed()``)."""
        lru, h0 = self._lru, self._head
        taken = lru[h0 : h0 + n]
        h = h0 + len(taken)
        if self._tombs:  # filter(None) drops the tombstones in C: 0 is the only falsy block id
            taken = list(filter(None, taken))
            while len(taken) < n and h < len(lru):  # refill for them (more may follow)
                more = lru[h : h + n - len(taken)]
                h += len(more)
                taken += filter(None, more)
            self._tombs -= h - h0 - len(taken)
        if h >= _COMPACT_MIN and 2 * h >= len(lru):
            del lru[:h]
            self._base += h
            h = 0
        self._head = h
        return taken

    def releaser(self) -> tuple[Callable[[int], None], list[int], int]:
        """For a caller's hot loop (the free path), valid until the queue next changes: for a
        hashed block (evicted after every block freed before it) ``pos[b] = k; k += 1;
        push_back(b)``, with ``k`` starting at the returned position. Stores and appends cost
        less than a method call. Unhashed blocks go through ``prepend``."""
        return self._lru.append, self._pos, self._base + len(self._lru)

    def prepend(self, blocks: list[int]) -> None:
        """Puts unhashed blocks at the front, ``blocks[0]`` first (as vLLM's ``prepend_n``: the
        blocks of one free, tail first, are reused tail first)."""
        self._front.extend(reversed(blocks))

    def move_to_front(self, block_id: int) -> None:
        """A free block that just lost its hash joins the unhashed segment."""
        self._front.append(block_id)

    def clear_hashes(self) -> list[int]:
        """Drops the hashed segment into the unhashed one, behind the blocks already there and
        in their order (vLLM's reset leaves its queue as it was); returns them."""
        moved = self._live()
        self._base += len(self._lru)
        self._lru, self._head, self._tombs = [], 0, 0
        self._front[:0] = reversed(moved)  # the stack's bottom is the queue's back
        return moved

    def segments(self) -> tuple[list[int], list[int]]:
        """The two segments (front: a stack, its top last; lru: oldest first), for the snapshot
        codec (manager/core/snapshot.py); ``from_segments`` takes them back."""
        return self._front, self._live()

    @classmethod
    def from_segments(cls, front: list[int], lru: list[int]) -> FreeQueue:
        """The queue of ``segments``; the owner calls ``reserve`` with its block count."""
        fq = cls(())
        fq._front = front
        fq._lru = list(lru)
        fq._pos = [0] * (bulk_max(lru) + 1 if lru else 1)
        if lru and bulk_min(lru) >= 0:  # else corrupt: the loader's verify names it, not an IndexError here
            bulk_store(fq._pos, lru, range(len(lru)))  # in C, in pieces: 1M blocks
        return fq

    def order(self) -> list[int]:
        """The queue front to back (tests and snapshots; O(n))."""
        return list(reversed(self._front)) + self._live()

    def _live(self) -> list[int]:
        live = self._lru[self._head :]
        return [b for b in live if b != _TOMB] if self._tombs else live
