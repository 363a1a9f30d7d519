"""The node tier's disk I/O, off the step's critical path: a small, bounded set of daemon threads
reads disk slots into private blocks and writes blocks down to disk slots (file I/O releases the
GIL) while the step's thread runs its other orders, and the step waits for each with a deadline.

A read or write that misses its deadline fails like one that does not verify (a ``Failure`` of
reason ``deadline``): the worker reports the order late, so the manager drops the hash as for
any failed order (a slot an I/O hung on is not tried again) and counts a deadline miss, not a
verify or save failure; a late read's block is recomputed by the forward pass. Nothing waits
for it again.

A late read may still be blocked in the file system (a hung network mount; a FIFO in the tests)
and may complete at any later time. It only ever writes into the block it allocated for itself,
which nobody else sees: the host slot a prefetch fills is written by the step's own thread
(worker/node_copier.py), only with a block that arrived within the deadline. So a late read
never lands in a slot the manager has handed to another block since. A late write may still
commit its file (worker/node_store.py: a temporary file renamed over the slot's) after the
manager gave the slot to another block: that file names the old key, so the load of the new one
fails its check and is recomputed, never served. An I/O still queued when its deadline passes
is cancelled and never runs. The threads are daemons, so one blocked for ever holds up neither
the step nor the process's exit; while every thread is held by a late I/O, new ones fail at once
(``deadline``) instead of queueing behind them for a whole deadline each step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from kvpool.worker.node_store import DiskStore, Failure

logger = logging.getLogger(__name__)

IO_THREADS = 4  # disk reads and writes in flight at once (more only queue in the kernel)

Pending = Future  # of (Failure | None, the verified block of a read | None)


class DiskIO:
    """Verified reads of one disk level's slots, each into a private block, and writes of blocks
    to its slots, each with a deadline."""

    def __init__(self, disk: DiskStore, timeout_s: float, threads: int = IO_THREADS) -> None:
        if not timeout_s > 0 or threads < 1:
            raise ValueError(f"need a disk I/O timeout > 0 s and at least one thread, got {timeout_s} s, {threads}")
        self.disk, self.timeout_s, self.threads = disk, timeout_s, threads
        self._queue: queue.SimpleQueue[tuple[Pending, int, bytes, torch.Tensor | None] | None] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()
        self._late = 0  # I/Os past their deadline that still hold a thread

    @property
    def late(self) -> int:
        """I/Os past their deadline still running (each holds a thread)."""
        return self._late

    def start(self, slot: int, key: bytes) -> Pending:
        """Starts reading disk ``slot`` (the block ``key`` names) into a block of its own."""
        return self._submit(slot, key, None)

    def start_write(self, slot: int, key: bytes, block: torch.Tensor) -> Pending:
        """Starts writing ``block`` (which nobody may change until it is done) as ``key`` to
        disk ``slot``."""
        return self._submit(slot, key, block)

    def _submit(self, slot: int, key: bytes, block: torch.Tensor | None) -> Pending:
        fut: Pending = Future()
        if self._late >= self.threads:  # every thread is held by a late I/O: this one would queue
            fut.set_result((Failure("deadline", f"disk slot {slot}: all {self.threads} disk I/O threads are "
                                    f"blocked in late reads or writes"), None))
            return fut
        if self._started < self.threads:
            threading.Thread(target=self._serve, name=f"kvpool-disk-io-{self._started}", daemon=True).start()
            self._started += 1
        self._queue.put((fut, slot, key, block))
        return fut

    def wait(self, fut: Pending, slot: int, deadline: float) -> tuple[Failure | None, torch.Tensor | None]:
        """The I/O's outcome if it completes by ``deadline`` (``time.monotonic()``): a read's
        block, or None for a write; else a ``deadline`` Failure, and the I/O is abandoned
        (cancelled if it has not started)."""
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            pass
        if not fut.cancel():  # running: it keeps its thread until the file system answers
            with self._lock:
                self._late += 1
            fut.add_done_callback(self._landed_late)  # runs at once if it finished meanwhile
        return Failure("deadline", f"disk slot {slot}: no answer from the disk within {self.timeout_s:g} s"), None

    def close(self) -> None:
        """Idle threads end; one blocked in a late read ends when its read returns."""
        for _ in range(self._started):
            self._queue.put(None)
        self._started = 0

    def _landed_late(self, fut: Pending) -> None:
        with self._lock:
            self._late -= 1
        logger.info("node tier: a disk read or write completed after its deadline (a read's block is dropped)")

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, slot, key, block = item
            if not fut.set_running_or_notify_cancel():
                continue  # abandoned before it started
            try:
                if block is not None:
                    fut.set_result((self.disk.write(slot, key, block), None))
                    continue
                block = self.disk.layout.empty_block()
                failure = self.disk.read_into(slot, key, block)
                fut.set_result((failure, None if failure is not None else block))
            except BaseException as e:  # a bug: raised on the step's thread by ``wait``
                fut.set_exception(e)
