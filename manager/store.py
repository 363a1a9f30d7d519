"""Per-iteration sinks of the manager loop: the state store and the KV-event publisher.

The loop (manager/server.py) runs, once per iteration and in this order::

    handle every message -> store.commit(registry, dirty) -> publisher.publish(...) -> send replies

so every mutation an iteration made is durable before any client hears about it (group commit:
one commit per iteration, however many messages it held). ``dirty`` names what changed: pool
names, plus ``GLOBAL`` when sessions or manager-wide flags (draining) changed. All state lives in the
``Registry`` (manager/registry.py), which a store may snapshot whole or by pool.

The memory store keeps nothing (a restarted manager starts empty and workers re-register); a
Redis store with recovery plugs in here later. The publisher receives each pool's KV events
(``manager/block_pool.py`` Event tuples) drained after the iteration; the null one drops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpool.manager.registry import Registry

GLOBAL = "\x00global"  # dirty marker: sessions or manager-wide flags (not a valid pool name)


class StateStore(Protocol):
    def load(self, registry: Registry) -> bool:
        """Restores ``registry`` from the store at start-up; False when there was nothing."""
        ...

    def commit(self, registry: Registry, dirty: set[str]) -> None:
        """Makes this iteration's mutations durable; the loop sends no reply before it returns."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """No persistence: commit is a no-op. Counts commits so tests can see the hook runs."""

    def __init__(self) -> None:
        self.commits = 0

    def load(self, registry: Registry) -> bool:
        return False

    def commit(self, registry: Registry, dirty: set[str]) -> None:
        if dirty:
            self.commits += 1

    def close(self) -> None:
        pass


class EventPublisher(Protocol):
    def publish(self, pool: str, epoch: int, events: list[tuple]) -> None:
        """KV events of one pool from one iteration, in order (the list is the caller's)."""
        ...

    def close(self) -> None: ...


class NullPublisher:
    """Drops events; counts them so tests can see the hook runs."""

    def __init__(self) -> None:
        self.events = 0

    def publish(self, pool: str, epoch: int, events: list[tuple]) -> None:
        self.events += len(events)

    def close(self) -> None:
        pass
