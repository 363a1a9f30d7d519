"""Per-message timings of the manager loop: where a client's round trip goes inside the daemon.

An iteration's duration (``iteration_recent`` in manager/stats.py) mixes how many messages it
batched with how long each one took, and a client sees neither. Its message waits in the socket
while the loop serves an earlier iteration, is read at the start of the next one (``ready``),
waits behind the messages read before it (``start``), is handled (``handled``; the loop's own CPU
for it is ``cpu``), and its reply is handed to the socket (``sent``, taken as the send begins:
at once without persistence and KV events, else after the iteration's group commit). This ring
keeps those points for the last RECENT messages, so the stats op reports the daemon's own
per-message work apart from queueing, and a benchmark on the same host can join the rows with
its clients' send and receive times: the times are ``time.perf_counter``, CLOCK_MONOTONIC on
Linux, one clock for every process there (scripts/rtt_breakdown.py).

The loop is the only writer; ``summary`` and ``columns`` copy the deque first (atomic under
the GIL), like the rest of ServerStats.
"""

from __future__ import annotations

from collections import deque
from operator import itemgetter

import numpy as np

RECENT = 16384  # messages whose timings are kept (a few seconds of a busy daemon)
FIELDS = ("session", "id", "op", "ready", "start", "handled", "sent", "cpu")
# the spans summed up per op: name -> (later field, earlier field); cpu is reported as is
SPANS = {"behind": ("start", "ready"), "service": ("handled", "start"), "held": ("sent", "handled")}


class MessageTimes:
    """A ring of one row per message: (session number or -1, message id or -1, op or "", then
    ready, start, handled, sent in perf_counter seconds, and the loop thread's CPU seconds
    spent handling it)."""

    __slots__ = ("rows",)

    def __init__(self, size: int = RECENT) -> None:
        if size < 1:
            raise ValueError(f"MessageTimes needs room for at least one message, got size={size}")
        self.rows: deque[tuple] = deque(maxlen=size)

    def observe(self, who: tuple[int, int, str], ready: float, start: float, handled: float, sent: float,
                cpu: float) -> None:
        self.rows.append((*who, ready, start, handled, sent, cpu))

    def summary(self) -> dict:
        """Exact quantiles per op of ``behind`` (waiting behind earlier messages of the same
        iteration), ``service`` (handling wall time), ``cpu`` (the loop's CPU within it: the
        rest is waiting for a core) and ``held`` (handled to sent: the group commit)."""
        rows = list(self.rows)
        if not rows:
            return {}
        n = len(rows)
        # The stats op runs on the loop: columns come out by C iterators and the quantiles are
        # picked by a partition, not sorted (sorting five 16,384-row columns per op in Python
        # took about 20 ms of the loop on the development machine; this about 5)
        col = {name: np.fromiter(map(itemgetter(i), rows), np.float64, n) for i, name in enumerate(FIELDS) if i > 2}
        ops = np.array(list(map(itemgetter(2), rows)), dtype=object)
        out = {}
        for op in sorted(set(ops.tolist())):
            mask = ops == op
            spans = {name: col[a][mask] - col[b][mask] for name, (a, b) in SPANS.items()}
            out[op or "invalid"] = _op_summary(spans | {"cpu": col["cpu"][mask]})
        return dict(sorted(out.items()))

    def columns(self) -> dict[str, list]:
        """The rows as one list per field (FIELDS): the stats op's ``message_rows``."""
        rows = list(self.rows)
        return {name: [r[i] for r in rows] for i, name in enumerate(FIELDS)}


def ranked(xs: np.ndarray, ranks: list[int]) -> list[float]:
    """The values at ``ranks`` (0-based) of ``xs`` once sorted, exactly as indexing a sorted
    copy would give them, in O(n)."""
    part = np.partition(xs, ranks)
    return [float(part[k]) for k in ranks]


def _op_summary(columns: dict[str, np.ndarray]) -> dict:
    n = len(columns["cpu"])
    ranks = [n // 2, min(n - 1, n * 99 // 100), n - 1]
    out: dict = {"count": n}
    for name, xs in columns.items():
        p50, p99, top = ranked(xs, ranks)
        out |= {f"{name}_p50": p50, f"{name}_p99": p99, f"{name}_max": top}
    return out
