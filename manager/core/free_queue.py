"""The free-block queue: O(1) pop from the front, push to either end, removal from the middle.

Logically one queue, ``[unhashed blocks ... | hashed blocks in LRU order ...]``, popped from the
front (DESIGN invariant 7). Blocks without a hash have no value and are pushed to the front;
blocks with a hash are pushed to the back, so the least recently freed cached block is evicted
first. Only hashed blocks are ever removed from the middle (a prefix-cache hit revives them).

It is stored as two segments, which keeps every operation O(1) and the bulk ones in C:
- ``_front``: a list used as a stack whose top is the queue's front (unhashed blocks);
- ``_lru``: an insertion-ordered dict of hashed blocks, oldest first.
The queue stays ``front + lru`` because a block never gains a hash while it is free, and the
only operations that drop hashes of free blocks (evict, reset) move those blocks to the front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import islice


class FreeQueue:
    __slots__ = ("_front", "_lru")

    def __init__(self, block_ids: range | list[int]) -> None:
        # Pop order is the given order: block_ids[0] comes out first.
        self._front: list[int] = list(reversed(block_ids))
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + len(self._lru)

    def num_hashed(self) -> int:
        return len(self._lru)

    def remove(self, block_id: int) -> None:
        """Takes a hashed free block out of the middle (a prefix-cache hit)."""
        del self._lru[block_id]

    def pop_unhashed(self, n: int) -> list[int]:
        """Up to ``n`` blocks from the unhashed segment, front first."""
        front = self._front
        k = min(n, len(front))
        if k == 0:
            return []
        taken = front[-k:]
        del front[-k:]
        taken.reverse()
        return taken

    def pop_hashed(self, n: int) -> list[int]:
        """The ``n`` least recently freed hashed blocks (the caller drops their hashes)."""
        lru = self._lru
        taken = list(islice(lru, n))
        for b in taken:
            del lru[b]
        return taken

    def releaser(self) -> tuple[Callable[[int], None], OrderedDict[int, None]]:
        """For a caller's hot loop (the free path): ``push_front(b)`` for an unhashed block
        (reused first), and the LRU segment itself, where ``lru[b] = None`` appends a hashed one
        (evicted after every block freed before it). A subscript store costs less than a call."""
        return self._front.append, self._lru

    def move_to_front(self, block_id: int) -> None:
        """A free block that just lost its hash joins the unhashed segment."""
        self._front.append(block_id)

    def clear_hashes(self) -> list[int]:
        """Moves every hashed block to the unhashed segment; returns them."""
        moved = list(self._lru)
        self._lru.clear()
        self._front.extend(reversed(moved))
        return moved

    def segments(self) -> tuple[list[int], list[int]]:
        """The two segments as stored (front: a stack, its top last; lru: oldest first), for
        the snapshot codec (manager/core/snapshot.py); ``from_segments`` takes them back."""
        return self._front, list(self._lru)

    @classmethod
    def from_segments(cls, front: list[int], lru: list[int]) -> FreeQueue:
        fq = cls(())
        fq._front = front
        fq._lru = OrderedDict.fromkeys(lru)
        return fq

    def order(self) -> list[int]:
        """The queue front to back (tests and snapshots; O(n))."""
        return list(reversed(self._front)) + list(self._lru)
