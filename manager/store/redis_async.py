"""The writer thread of ``--durability async``: journal batches reach Redis after the replies.

The loop queues items in commit order; the thread writes them in that order, merging the
batches waiting in the queue into one script call (one round trip for many iterations):

    ("blobs", first_seq, [batch...])   ("snapshot", data, seq)   ("renew",)

The loss window on a crash is what sits in the queue plus the call in flight: at most
``ASYNC_MAX_PENDING`` items (the loop blocks when Redis falls that far behind, which bounds it).
A failed write stops the writing: the error is raised to the loop at its next ``put`` (the loop
then stops acknowledging and recovers from Redis), and what was queued is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvpool.manager.store.base import Fenced, StoreUnavailable

logger = logging.getLogger(__name__)
ASYNC_MAX_PENDING = 256  # queued items (iterations) before the loop waits for Redis
_MERGE = 512  # batches in one script call at most


class AsyncWriter:
    def __init__(self, write_blobs: Callable[[int, list[bytes]], None],
                 write_snapshot: Callable[[bytes, int], None]) -> None:
        self._write_blobs, self._write_snapshot = write_blobs, write_snapshot
        self._q: queue.Queue = queue.Queue(maxsize=ASYNC_MAX_PENDING)
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kvpool-redis-writer", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        if self.error is not None:
            raise self.error
        self._q.put(item)

    def flush(self) -> None:
        """Waits until everything queued was written (or dropped after an error)."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            items = [self._q.get()]
            while len(items) < _MERGE:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is None for item in items)
            try:
                if self.error is None:
                    self._write([item for item in items if item is not None])
            except (StoreUnavailable, Fenced) as e:
                logger.error("async commit failed: %s; the batches queued after it are lost", e)
                self.error = e
            finally:
                for _ in items:
                    self._q.task_done()
            if stop:
                return

    def _write(self, items: list[tuple]) -> None:
        first, blobs = 0, []
        for item in items:
            if item[0] == "blobs":
                if not blobs:
                    first = item[1]
                blobs.extend(item[2])
                continue
            if blobs:
                self._write_blobs(first, blobs)
                blobs = []
            if item[0] == "snapshot":
                self._write_snapshot(*item[1:])
            elif item[0] == "renew":
                self._write_blobs(0, [])
        if blobs:
            self._write_blobs(first, blobs)
