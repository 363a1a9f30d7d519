"""Per-iteration sinks of the manager loop: the state store and the KV-event sink.

The loop (manager/server.py; the commit step is manager/group_commit.py) runs, once per iteration
and in this order::

    handle every message -> store.commit(registry, dirty) -> publisher.publish(...) -> send replies

so every mutation an iteration made is durable before any client hears about it (group commit:
one commit per iteration, however many messages it held). ``dirty`` names what changed: pool
names, plus ``registry.GLOBAL`` when sessions or manager-wide flags (draining) changed. All state lives in the
``Registry`` (manager/registry.py), which a store sees as a ``StateView`` (manager/store/view.py)
and may snapshot whole or by pool.

The memory store keeps nothing (a restarted manager starts empty and workers re-register). The
Redis store (manager/store/redis_store.py) journals the registry's mutations (manager/store/journal.py) and
snapshots it, so a restarted manager, or a standby taking over, recovers the exact state. A
store that cannot commit raises ``StoreUnavailable``; one that lost its lease to another
manager raises ``Fenced``: the loop then acknowledges nothing of the iteration. The event sink (the ZeroMQ publisher of manager/events.py, or the null one) receives each pool's KV events
(``manager/core/kv_events.py`` records, taken from each pool after the iteration); the null one
drops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpool.manager.core.kv_events import KVEvent
    from kvpool.manager.store.view import StateView


class StoreUnavailable(Exception):
    """The store cannot be reached: what was not committed must not be acknowledged."""


class Fenced(Exception):
    """Another manager holds the lease (a standby took over): this one must stop serving."""


class StateStore(Protocol):
    durable: bool  # state survives this process

    def acquire(self) -> bool:
        """Takes (or renews) the lease; False while another manager holds it. May raise
        StoreUnavailable."""
        ...

    def load(self, registry: StateView, now: float) -> bool:
        """Restores the empty ``registry`` (after ``acquire``); False when there was nothing.
        Raises CorruptState (manager/core/snapshot.py) rather than load part of a state."""
        ...

    def commit(self, registry: StateView, dirty: set[str]) -> None:
        """Makes this iteration's mutations durable; called every iteration (dirty or not, so a
        store can renew its lease); the loop sends no reply before it returns."""
        ...

    def saw(self, state_id: str, seq: int) -> None:
        """A client saw commit ``seq`` of ``state_id``: a load must not serve it below that."""
        ...

    def stats(self) -> dict: ...

    def shutdown(self, registry: StateView | None) -> None:
        """A clean stop: a last snapshot of ``registry`` (None: not ours, we are not active),
        the lease released."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """No persistence: commit is a no-op. Counts commits so tests can see the hook runs."""

    durable = False

    def __init__(self) -> None:
        self.commits = 0

    def acquire(self) -> bool:
        return True

    def load(self, registry: StateView, now: float) -> bool:
        return False

    def commit(self, registry: StateView, dirty: set[str]) -> None:
        if dirty:
            self.commits += 1

    def saw(self, state_id: str, seq: int) -> None:
        pass

    def stats(self) -> dict:
        return {"kind": "memory"}

    def shutdown(self, registry: StateView | None) -> None:
        pass

    def close(self) -> None:
        pass


class EventSink(Protocol):
    def publish(self, pool: str, epoch: int, events: list[KVEvent]) -> None:
        """KV events of one pool from one iteration, in order (the list is the caller's)."""
        ...

    def close(self) -> None: ...


class NullSink:
    """Drops events; counts them so tests can see the hook runs."""

    def __init__(self) -> None:
        self.events = 0

    def publish(self, pool: str, epoch: int, events: list[KVEvent]) -> None:
        self.events += len(events)

    def close(self) -> None:
        pass
