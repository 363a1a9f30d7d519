"""A request's blocks as the manager holds them, the way this worker knows it: ``req.kv``.

The scheduler keeps the manager's view of each request so that a step message carries only what
changed (PROTOCOL.md, "Sparse steps"): a running request sends an extend only when its tokens
need a slot beyond ``num_slots``, or after a fork (``must_sync``), with the hashes the manager
lacks (past ``num_hashes_sent``). ``synced_tokens`` is the manager's ``num_tokens`` for it.

A sub-op changes the view when it is sent (the manager is assumed to accept it, so the next
step, with overlap, builds on it) and again when it is answered: a refused extend puts the view
back (``undo``), an answer brings the block table. Every change is a method here; the scheduler
(worker/scheduler.py, worker/step_outcome.py, worker/running_set.py) calls them.
"""

from __future__ import annotations

from collections.abc import Iterable

# (hashes sent, synced tokens, slots) before an extend: what a refusal puts back
Undo = tuple[int, int, int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVView:
    __slots__ = ("block_table", "synced_tokens", "num_slots", "num_hashes_sent", "must_sync")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.synced_tokens = 0  # the manager's num_tokens for this request
        self.num_slots = 0  # slots of the blocks the manager gave (or was asked for)
        self.num_hashes_sent = 0  # hashes the manager knows for this request
        self.must_sync = False  # forked: the next write must reach the manager (copy-on-write)

    def reset(self) -> None:
        """The manager holds nothing for the request (preempted, lost, refused)."""
        self.block_table = []
        self.synced_tokens = self.num_slots = self.num_hashes_sent = 0
        self.must_sync = False

    # -- sub-ops sent ------------------------------------------------------------------------

    def alloc_sent(self, num_tokens: int, num_slots: int, num_hashes: int) -> None:
        """An admission asked for ``num_tokens`` in at most ``num_slots`` slots, with its hashes."""
        self.num_slots = num_slots
        self.synced_tokens = num_tokens
        self.num_hashes_sent = num_hashes

    def extend_sent(self, num_tokens: int, num_hashes: int, num_slots: int) -> Undo:
        """An extend to ``num_tokens`` (``num_slots`` slots needed) with ``num_hashes`` new hashes;
        returns what a refusal puts back."""
        undo = (self.num_hashes_sent, self.synced_tokens, self.num_slots)
        self.num_hashes_sent += num_hashes
        self.synced_tokens = num_tokens
        if num_slots > self.num_slots:
            self.num_slots = num_slots
        return undo

    def fork_sent(self, parent: KVView, num_tokens: int, block_size: int) -> None:
        """This child shares ``parent``'s blocks of its ``num_tokens`` computed tokens; both must
        write through the manager next (the shared partial block is copied on first write)."""
        self.synced_tokens = num_tokens
        self.num_slots = cdiv(num_tokens, block_size) * block_size
        self.num_hashes_sent = min(parent.num_hashes_sent, num_tokens // block_size)
        self.mark_shared()
        parent.mark_shared()

    def mark_shared(self) -> None:
        """The next write must reach the manager, whatever slots the request holds."""
        self.must_sync = True

    # -- answers ----------------------------------------------------------------------------

    def undo(self, before: Undo) -> None:
        """The manager refused the extend that returned ``before``."""
        self.num_hashes_sent, self.synced_tokens, self.num_slots = before

    def set_table(self, blocks: Iterable[int]) -> None:
        self.block_table = list(blocks)

    def add_blocks(self, blocks: list[int], copies: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """``blocks`` appended; ``copies`` (index, new block) replace shared ones (copy-on-write).
        Returns (replaced block, new block) of each copy."""
        table = self.block_table
        table.extend(blocks)
        replaced = []
        for index, dst in copies:
            replaced.append((table[index], dst))
            table[index] = dst
        return replaced

    def forked(self, block_size: int) -> None:
        """The fork was answered (the table set): the slots are the blocks it shares."""
        self.num_slots = len(self.block_table) * block_size

    def extended(self, wrote: bool, block_size: int) -> None:
        """An extend went through; ``wrote``: it wrote tokens (a sync carries none), so a block
        it shared was copied and the request writes on its own from now on."""
        self.num_slots = max(self.num_slots, len(self.block_table) * block_size)
        self.must_sync = self.must_sync and not wrote

    def allocated(self, num_tokens: int, cached: int, asked: int, block_size: int) -> None:
        """An admission of a ``num_tokens`` prompt went through with ``cached`` tokens hit,
        asking for ``asked`` tokens (a later step in flight may have moved the counts on: max)."""
        self.num_slots = max(self.num_slots, len(self.block_table) * block_size)
        self.synced_tokens = max(self.synced_tokens, cached + min(num_tokens - cached, asked))
