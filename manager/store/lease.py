"""Keeping a lease alive while the loop's thread is busy (loading a large state).

A standby that takes the lease and then spends seconds loading must keep renewing it, in small
steps, so that if it dies mid-load the lease lapses within ``lease_ms`` and the next standby
takes over (it used to take a 120 s lease for the whole load).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvpool.manager.store.base import Fenced, StoreUnavailable

logger = logging.getLogger(__name__)


@contextmanager
def renewing(renew: Callable[[], None], every_s: float, what: str) -> Iterator[None]:
    """Calls ``renew`` every ``every_s`` from a thread while the body runs.

    A renewal that fails for want of the store (a timeout under load) is tried again at the next
    turn: the lease may well still be this manager's, and giving up would hand it to a standby
    while this one is alive and loading. A fenced renewal (another manager holds the lease) stops
    the renewing; the body's own writes then find the lease lost.
    """
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            try:
                renew()
            except StoreUnavailable as e:
                logger.warning("%s: lease renewal while loading failed (tried again in %.2fs): %s", what, every_s, e)
            except Fenced as e:
                logger.warning("%s: the lease went to another manager while loading: %s", what, e)
                return

    thread = threading.Thread(target=run, name="kvpool-lease-while-loading", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
