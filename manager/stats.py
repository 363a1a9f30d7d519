"""Counters of the manager loop, kept in one object that metrics exporters read.

The loop is the only writer. A reader in another thread (a metrics HTTP server) calls
``snapshot()``, which copies plain ints and lists: good enough for monitoring without locks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np

from kvpool.manager.message_times import MessageTimes, ranked

RECENT = 8192  # busy iterations whose exact durations are kept (stats op: iteration_recent)

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
    busy_poll: Any = None  # the loop's BusyPoll (manager/busy_poll.py): spin hits, misses, time
    # (wall seconds, CPU seconds of the loop's thread, messages) of the last RECENT busy
    # iterations: exact quantiles where the histogram has 1-2-5 buckets, and wall against CPU,
    # so a benchmark can tell the daemon's own work from its waiting for a CPU
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    # each recent message's way through the loop (manager/message_times.py): queueing apart
    # from the daemon's own work, per message where ``recent`` has whole iterations
    message_times: MessageTimes = field(default_factory=MessageTimes)
    gc_collections: int = 0  # the loop's own full collections (manager/timers.py maybe_gc)
    gc_s: float = 0.0
    gc_max_s: float = 0.0
    # objects out of the collector's sight, counted when they were frozen (settle_heap): asking
    # gc.get_freeze_count() walks that whole list, tens of ms under a 1M-block state, per stats call
    frozen: int = 0

    def observe_iteration(self, seconds: float, cpu_s: float, messages: int) -> None:
        self.iteration_latency.observe(seconds)
        self.recent.append((seconds, cpu_s, messages))

    def observe_frozen(self, objects: int) -> None:
        """``objects`` were moved out of the collector's sight (settle_heap)."""
        self.frozen = objects

    def observe_gc(self, seconds: float) -> None:
        self.gc_collections += 1
        self.gc_s += seconds
        self.gc_max_s = max(self.gc_max_s, seconds)

    def recent_summary(self) -> dict:
        """Exact quantiles of the recent busy iterations (list() of a deque: atomic under the GIL)."""
        rows = list(self.recent)
        if not rows:
            return {"count": 0}
        n = len(rows)
        out: dict = {"count": n}
        ranks = [n // 2, min(n - 1, n * 9 // 10), min(n - 1, n * 99 // 100), n - 1]
        for key, col in (("", 0), ("cpu_", 1)):  # picked, not sorted: the stats op runs on the loop
            p50, p90, p99, top = ranked(np.fromiter(map(itemgetter(col), rows), np.float64, n), ranks)
            out |= {f"{key}p50": p50, f"{key}p90": p90, f"{key}p99": p99, f"{key}max": top}
        messages = list(map(itemgetter(2), rows))
        return out | {"messages_mean": sum(messages) / n, "messages_max": max(messages)}

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
            "busy_poll": self.busy_poll.snapshot() if self.busy_poll is not None else None,
            "iteration_recent": self.recent_summary(),
            "message_recent": self.message_times.summary(),
            "gc": {"collections": self.gc_collections, "seconds": self.gc_s, "max_s": self.gc_max_s,
                   "frozen": self.frozen},
        }
