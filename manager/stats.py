"""Counters of the manager loop, kept in one object that metrics exporters read.

The loop is the only writer. A reader in another thread (a metrics HTTP server) calls
``snapshot()``, which copies plain ints and lists: good enough for monitoring without locks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

# Bucket upper bounds in seconds (1-2-5 series, 10 us .. 1 s), Prometheus-style cumulative on export.
LATENCY_BOUNDS = tuple(m * 10.0**e for e in range(-5, 0) for m in (1, 2, 5)) + (1.0,)


class LatencyHistogram:
    __slots__ = ("counts", "total", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS) + 1)  # the last bucket is +Inf
        self.total = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.total += 1
        self.sum += seconds

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0.0 when empty, inf past 1 s)."""
        if not self.total:
            return 0.0
        rank, seen = q * self.total, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return LATENCY_BOUNDS[i] if i < len(LATENCY_BOUNDS) else float("inf")
        return float("inf")

    def snapshot(self) -> dict:
        return {
            "bounds": list(LATENCY_BOUNDS),
            "counts": list(self.counts),
            "count": self.total,
            "sum": self.sum,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
        }


@dataclass
class ServerStats:
    messages: int = 0  # payloads received (including bad ones)
    replies: int = 0  # replies handed to the socket
    dropped: int = 0  # messages with a malformed envelope (no reply possible)
    replies_dropped: int = 0  # replies the socket refused (client gone or not reading)
    iterations: int = 0
    sessions_expired: int = 0
    expired_requests_freed: int = 0
    sub_ops: int = 0
    ops: Counter = field(default_factory=Counter)  # op name -> count (valid envelopes only)
    errors: Counter = field(default_factory=Counter)  # error code -> count
    step_latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # handling, per step
    iteration_latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # busy iterations
    commit_latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # store.commit calls
    event_batches: int = 0  # KV-event batches handed to the publisher (= its next sequence number)
    events: int = 0  # KV events in them

    def snapshot(self) -> dict:
        return {
            "messages": self.messages,
            "replies": self.replies,
            "dropped": self.dropped,
            "replies_dropped": self.replies_dropped,
            "iterations": self.iterations,
            "sessions_expired": self.sessions_expired,
            "expired_requests_freed": self.expired_requests_freed,
            "sub_ops": self.sub_ops,
            "ops": dict(self.ops),
            "errors": dict(self.errors),
            "step_latency": self.step_latency.snapshot(),
            "iteration_latency": self.iteration_latency.snapshot(),
            "commit_latency": self.commit_latency.snapshot(),
            "event_batches": self.event_batches,
            "events": self.events,
        }
