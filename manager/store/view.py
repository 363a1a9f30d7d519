"""What the store sees of the registry: a narrow state view, and the moves it may make on it.

The store (journal, state files, the Redis store, recovery) reads the registry's records
(manager/state/) and changes the registry only through these methods; ``Registry``
(manager/registry.py) implements them and is the one writer of its fields. So the store sits
below the daemon and never imports it (tests/test_layout.py checks both).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Protocol, Self

from kvpool.manager.state.attachment import Attachment
from kvpool.manager.state.entries import PoolEntry, Session
from kvpool.manager.state.mutations import Mutation


class StateView(Protocol):
    @property
    def incarnation(self) -> str: ...

    @property
    def state_id(self) -> str: ...

    @property
    def seq(self) -> int:
        """The last committed batch (the store's commit sequence)."""
        ...

    @property
    def durable(self) -> bool: ...

    @property
    def next_num(self) -> int: ...

    @property
    def draining(self) -> bool: ...

    @property
    def sessions(self) -> Mapping[str, Session]: ...

    @property
    def pools(self) -> Mapping[str, PoolEntry]: ...

    @property
    def attachments(self) -> Mapping[str, Attachment]: ...

    def total_requests(self) -> int: ...

    def apply(self, rec: Mutation, now: float) -> object:
        """Runs one mutation record (the journal's replay), as the live call ran it."""
        ...

    def replaying(self) -> AbstractContextManager[None]:
        """Around a replay: limits checked when the records happened are not checked again."""
        ...

    def restore(self, sessions: list[Session], pools: list[PoolEntry], state_id: str, next_num: int,
                draining: bool, attachments: list[Attachment] = ()) -> None:
        """Fills the empty state from a decoded snapshot."""
        ...

    def take_log(self) -> list[Mutation]:
        """This iteration's records, to commit as one batch."""
        ...

    def mark_committed(self, seq: int) -> None: ...

    def mark_durable(self) -> None:
        """The store holds this state from now on: every mutation is journaled."""
        ...

    def rename(self, state_id: str) -> None: ...

    def start_over(self, state_id: str) -> None:
        """An empty state under a new id (the stored one went back in time)."""
        ...

    def discard_uncommitted(self) -> None:
        """A commit failed: this iteration's records, dirty marks and KV events are dropped."""
        ...

    def adopt(self, other: Self) -> None:
        """Takes over a state loaded into a fresh view (recovery)."""
        ...
