"""The one retry policy: how often, how long and with which pauses a call is tried again.

``RetryPolicy`` is the immutable rule (exponential pauses from ``first_pause_s`` up to
``max_pause_s``, a ``deadline_s`` after which nothing is retried, at most ``attempts`` tries);
``Backoff`` is one call's clock under it. Every retry loop of the clients (a call to a durable
manager resent across failover, ``register`` waiting out another holder of its shard) and the
worker's pause while its manager refuses admissions runs on these two, sync or asyncio alike.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RetryPolicy:
    deadline_s: float | None = None  # retries stop this long after the first try (None: never)
    attempts: int | None = None  # at most this many tries (None: as many as the deadline allows)
    first_pause_s: float = 0.02
    max_pause_s: float = 0.5
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s) and self.deadline_s >= 0):
            raise ValueError(f"deadline_s must be a finite number >= 0 or None, got {self.deadline_s}")
        if self.attempts is not None and (type(self.attempts) is not int or self.attempts < 1):
            raise ValueError(f"attempts must be an int >= 1 or None, got {self.attempts}")
        if not 0 < self.first_pause_s <= self.max_pause_s:
            raise ValueError(f"need 0 < first_pause_s <= max_pause_s, got {self.first_pause_s}, {self.max_pause_s}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")

    def with_deadline(self, deadline_s: float | None) -> RetryPolicy:
        return replace(self, deadline_s=deadline_s)

    def start(self) -> Backoff:
        return Backoff(self)


class Backoff:
    """One call's retries: tries counted, the deadline's clock running from ``start``, the next
    pause. ``current_s`` is 0 until the first ``advance`` (and again after ``reset``)."""

    __slots__ = ("policy", "tries", "deadline", "current_s")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.tries = 0
        self.deadline = math.inf if policy.deadline_s is None else time.monotonic() + policy.deadline_s
        self.current_s = 0.0

    def attempt(self) -> int:
        """Counts one try; returns how many were made."""
        self.tries += 1
        return self.tries

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def exhausted(self) -> bool:
        """No try may follow: the deadline passed, or every allowed attempt was made."""
        p = self.policy
        return self.expired() or (p.attempts is not None and self.tries >= p.attempts)

    def advance(self) -> float:
        """The next pause (first_pause_s, then each ``factor`` times the last, up to max_pause_s)."""
        p = self.policy
        self.current_s = min(max(self.current_s * p.factor, p.first_pause_s), p.max_pause_s)
        return self.current_s

    def reset(self) -> None:
        self.current_s = 0.0

    def pause_s(self) -> float:
        """The next pause, cut to the time left before the deadline."""
        return min(self.advance(), self.left_s())

    def sleep(self) -> None:
        time.sleep(self.pause_s())

    async def asleep(self) -> None:
        await asyncio.sleep(self.pause_s())
