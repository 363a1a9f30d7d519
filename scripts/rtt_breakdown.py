"""Splits each step round trip a benchmark client measured into where its time went.

The client records, per step, its message id, the perf_counter times it began the step, had
handed it to its socket and had the results, and on either side of that hand-over the time it
waited for a CPU (schedstat) and the time its garbage collector ran. The daemon keeps, per
message, the loop's times (manager/message_times.py: ready, start, handled, sent, and its CPU
for the message); both clocks are CLOCK_MONOTONIC on one Linux host, so the two join on
(session, id). A round trip is then the exact sum of (PARTS, in order):

    client_send  encoding the request and handing it to ZeroMQ (less GC and CPU wait there)
    socket       in the daemon's socket while the loop served earlier iterations
    to_loop      the rest of the way in: ZeroMQ's transfer, the loop's own work between
                 iterations and its wake-up (from poll, or a busy-poll spin)
    behind       behind earlier messages of its own iteration
    daemon_cpu   the loop's CPU handling this message (the daemon's own work)
    daemon_wait  the rest of its handling: the loop waiting for a core meanwhile
    held         its reply waiting for the iteration's commit (0 without persistence or KV events)
    to_client    the way back: ZeroMQ's transfer, the client's wake-up and decoding
    client_gc    the client's garbage collector, both sides of the hand-over
    client_wait  the client waiting for a core, both sides of the hand-over (after it, at most
                 the way back: before the reply was sent, a wait overlapped the daemon's work)

``socket`` and ``behind`` are queueing behind other clients' messages. The client's waits and
GC are taken apart before and after its hand-over, and the daemon's ``sent`` as its send
begins, so no two parts count the same moment: a client preempted while encoding would
otherwise show up as queueing, and one that runs before the loop does again as a negative
way back.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

PARTS = ("client_send", "socket", "to_loop", "behind", "daemon_cpu", "daemon_wait", "held", "to_client", "client_gc",
         "client_wait")
# within socket + behind (not added again): the loop's CPU on the messages ahead, and its
# waiting for a core while handling them; the rest is receiving and sending between them
QUEUE_PARTS = ("queue_cpu", "queue_wait")
# beside the parts, overlapping them: the client's other threads (ZeroMQ's I/O thread, which
# carries the request out and the reply in) waiting for a CPU during the step
ASIDE = ("client_io_wait",)
CLIENT_FIELDS = ("id", "begin", "sent", "recv", "send_wait", "recv_wait", "send_gc", "recv_gc", "io_wait")


class StepTimes:
    """The client side: times each step for ``join`` (CLIENT_FIELDS): message id, the
    perf_counter times it began the step, had handed it to its socket and had the results, the
    CPU wait (schedstat) and garbage-collector time on either side of the hand-over, and the CPU
    wait of the process's other threads (ZeroMQ's I/O thread) over the whole step. ``begin``
    sends a step and returns its pending call (with ``msg_id``); ``end`` waits for its results."""

    def __init__(self, begin: Callable[[list[dict]], Any], end: Callable[[Any], list[dict]]) -> None:
        self.begin, self.end = begin, end
        self.rows: list[tuple] = []
        self.gc_s = 0.0  # this process's collections so far (gc.callbacks)
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)
        # kept open: a pread is ~2 us where open+read+close is ~30 us, a few times a step
        self._main, self._others = _open_schedstat(os.getpid()), []
        for tid in _threads():
            fd = _open_schedstat(tid) if tid != os.getpid() else None
            if fd is not None:
                self._others.append(fd)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    def step(self, ops: list[dict]) -> list[dict]:
        clock, wait = time.perf_counter, _run_delay
        w0, o0, g0, t0 = wait(self._main), sum(map(wait, self._others)), self.gc_s, clock()
        pending = self.begin(ops)
        t1, w1, g1 = clock(), wait(self._main), self.gc_s
        results = self.end(pending)
        t2 = clock()
        self.rows.append((pending.msg_id, t0, t1, t2, w1 - w0, wait(self._main) - w1, g1 - g0, self.gc_s - g1,
                          sum(map(wait, self._others)) - o0))
        return results

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
        for fd in [self._main, *self._others]:
            if fd is not None:
                os.close(fd)
        self._main, self._others = None, []

    def columns(self) -> dict[str, np.ndarray]:
        cols = np.array(self.rows, dtype=float).reshape(-1, len(CLIENT_FIELDS)).T
        return dict(zip(CLIENT_FIELDS, cols, strict=True))


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _open_schedstat(tid: int) -> int | None:
    try:
        return os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
    except OSError:
        return None


def _run_delay(fd: int | None) -> float:
    """Seconds the thread has waited for a CPU while runnable (0 where schedstat is missing)."""
    return 0.0 if fd is None else int(os.pread(fd, 128, 0).split()[1]) / 1e9


def busy_clock(ready: np.ndarray, sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The daemon's busy iterations as sorted, disjoint intervals [ready, last reply sent]
    (every message of one iteration carries the same ``ready``); returns (starts, ends)."""
    starts, inverse = np.unique(ready, return_inverse=True)
    ends = np.full(len(starts), -np.inf)
    np.maximum.at(ends, inverse, sent)
    return starts, ends


def spread_between(starts: np.ndarray, ends: np.ndarray, amounts: np.ndarray, t0: np.ndarray,
                   t1: np.ndarray) -> np.ndarray:
    """For each pair, how much of ``amounts`` falls within [t0, t1], each interval's amount
    spread evenly over it (intervals sorted and disjoint, as a single-threaded loop's are)."""
    lengths = ends - starts
    rate = np.divide(amounts, lengths, out=np.zeros(len(lengths)), where=lengths > 0)
    cum = np.concatenate(([0.0], np.cumsum(amounts)))

    def until(t: np.ndarray) -> np.ndarray:  # the amount in (-inf, t]
        i = np.searchsorted(starts, t, side="right")  # intervals that began at or before t
        last = np.maximum(i - 1, 0)
        inside = np.where(i > 0, np.clip(t - starts[last], 0.0, lengths[last]) * rate[last], 0.0)
        return cum[last] * (i > 0) + inside

    return until(t1) - until(t0)


def busy_between(starts: np.ndarray, ends: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """For each pair, the time within [t0, t1] during which the loop was in a busy iteration."""
    return spread_between(starts, ends, ends - starts, t0, t1)


def _on_path(span: np.ndarray, stall: np.ndarray) -> np.ndarray:
    """The share of each ``stall`` that fits in its ``span`` of the round trip (1 where all of it
    does, and where there is no stall: a span is never below 0, so a stall above it is above 0)."""
    span = np.clip(span, 0.0, None)
    return np.divide(span, stall, out=np.ones(len(span)), where=stall > span)


def join(client: dict[int, dict[str, np.ndarray]], rows: dict[str, list]) -> dict[str, np.ndarray]:
    """Per joined step: the round trip and each of PARTS (seconds). ``client``: session number
    -> CLIENT_FIELDS arrays; ``rows``: the stats op's ``message_rows``. Steps whose row the
    daemon no longer keeps (its ring holds the latest messages) are left out."""
    d = {k: np.asarray(v) for k, v in rows.items()}
    starts, ends = busy_clock(d["ready"].astype(float), d["sent"].astype(float))
    index = {(int(s), int(i)): k for k, (s, i) in enumerate(zip(d["session"], d["id"], strict=True))}
    picks, sides = [], []
    for session, c in client.items():
        for j, msg_id in enumerate(c["id"]):
            k = index.get((session, int(msg_id)))
            if k is not None:
                picks.append(k)
                sides.append((session, j))
    if not picks:
        raise ValueError("no step joined the daemon's message rows: were they taken from this run's daemon?")
    k = np.array(picks)
    col = {f: np.array([client[s][f][j] for s, j in sides], dtype=float) for f in CLIENT_FIELDS}
    ready, start, handled, sent, cpu = (d[f][k].astype(float) for f in ("ready", "start", "handled", "sent", "cpu"))
    # ``ready`` is stamped once per iteration, before the loop drains its socket: a message that
    # arrived during the drain (a drain preempted under load) carries a ``ready`` before its
    # client even began the step. It was ready no earlier than that begin: without this, its
    # hand-over came before its begin and the send side's share of its stalls was 0 / 0 (NaN)
    ready = np.maximum(ready, col["begin"])
    # the hand-over: the client takes its clock after the send returns, and a client preempted
    # right after sending can take it after the loop already read the message (ready); it was
    # in the socket by then. Its stalls before its clock count only up to the hand-over (GC
    # and CPU wait in proportion): the rest overlapped the way in, as on the way back below
    handed = np.minimum(col["sent"], ready)
    out_stall = col["send_wait"] + col["send_gc"]
    before = handed - col["begin"]
    on_send = _on_path(before, out_stall)
    send_wait, send_gc = col["send_wait"] * on_send, col["send_gc"] * on_send
    socket = busy_between(starts, ends, handed, ready)
    # what the loop did while this message queued: others' handling, split into its CPU and its
    # waiting for a core (each message's spread evenly over its handling)
    h0, h1, hcpu = (d[f].astype(float) for f in ("start", "handled", "cpu"))
    order = np.argsort(h0, kind="stable")
    h0, h1 = h0[order], h1[order]
    hcpu = np.clip(hcpu[order], 0.0, h1 - h0)  # thread_time is coarser than perf_counter
    # the client's stalls after its hand-over lie on the round trip's path only once the reply
    # is on its way: one that came before (preempted before it polled) overlapped the daemon's
    # work, so at most the way back counts (GC and CPU wait in proportion)
    back, stall = col["recv"] - sent, col["recv_wait"] + col["recv_gc"]
    on_path = _on_path(back, stall)
    recv_wait, recv_gc = col["recv_wait"] * on_path, col["recv_gc"] * on_path
    return {"rtt": col["recv"] - col["begin"],
            "queue_cpu": spread_between(h0, h1, hcpu, handed, start),
            "queue_wait": spread_between(h0, h1, h1 - h0 - hcpu, handed, start),
            "client_send": before - send_wait - send_gc,
            "socket": socket, "to_loop": ready - handed - socket, "behind": start - ready,
            "daemon_cpu": cpu, "daemon_wait": handled - start - cpu, "held": sent - handled,
            "to_client": back - recv_wait - recv_gc,
            "client_gc": send_gc + recv_gc, "client_wait": send_wait + recv_wait,
            "client_io_wait": col["io_wait"]}


def attribute(parts: dict[str, np.ndarray]) -> dict:
    """Mean of each part over the steps at or above the round trip's p99 against the steps
    between its p45 and p55: what the tail adds, and where."""
    rtt = parts["rtt"]
    if not len(rtt) or np.isnan(rtt).any():
        raise ValueError(f"attribute needs round trips, all of them measured: got {len(rtt)}, "
                         f"{int(np.isnan(rtt).sum())} NaN")
    p45, p50, p55, p99 = np.percentile(rtt, [45, 50, 55, 99])
    tail, mid = rtt >= p99, (rtt >= p45) & (rtt <= p55)
    if not mid.any():  # under 11 steps, p45..p55 can fall between two of them: the one nearest p50
        mid = rtt == rtt[np.argmin(np.abs(rtt - p50))]
    out = {"steps": len(rtt), "tail_steps": int(tail.sum()), "p50_us": p50 * 1e6, "p99_us": p99 * 1e6}
    for name in ("rtt", *PARTS, *QUEUE_PARTS, *ASIDE):
        out[f"{name}_mid_us"] = float(parts[name][mid].mean() * 1e6)
        out[f"{name}_tail_us"] = float(parts[name][tail].mean() * 1e6)
    queue = parts["socket"] + parts["behind"]
    out["queue_share"] = float(queue.sum() / rtt.sum())
    for q in (50, 99):
        out[f"queue_p{q}_us"] = float(np.percentile(queue, q) * 1e6)
        out[f"service_p{q}_us"] = float(np.percentile(parts["daemon_cpu"] + parts["daemon_wait"], q) * 1e6)
        out[f"daemon_cpu_p{q}_us"] = float(np.percentile(parts["daemon_cpu"], q) * 1e6)
    return out


def tail_line(a: dict) -> str:
    """What the slowest 1% of steps add over the median ones, part by part, then in short:
    queueing behind other clients' work, the daemon's own work, waiting for a CPU, the rest."""
    def extra(*names: str) -> str:
        return f"{round(sum(a[f'{n}_tail_us'] - a[f'{n}_mid_us'] for n in names)):+,}"  # round: no "-0"

    a = {**a, "queue_rest_tail_us": a["socket_tail_us"] + a["behind_tail_us"] - a["queue_cpu_tail_us"]
         - a["queue_wait_tail_us"], "queue_rest_mid_us": a["socket_mid_us"] + a["behind_mid_us"]
         - a["queue_cpu_mid_us"] - a["queue_wait_mid_us"]}
    wire = ("client_send", "to_loop", "to_client", "held", "client_gc")
    return (f"the slowest 1% of steps ({a['tail_steps']}) take {a['rtt_tail_us']:,.0f} us against "
            f"{a['rtt_mid_us']:,.0f} us around p50 ({extra('rtt')} us): queueing behind other clients' messages "
            f"{extra('socket', 'behind')} (in the socket while the daemon served earlier iterations "
            f"{extra('socket')}, behind earlier messages of their own iteration {extra('behind')}; of it the "
            f"daemon's CPU on those messages {extra('queue_cpu')}, its waiting for a CPU while handling them "
            f"{extra('queue_wait')}, its receiving and sending between them {extra('queue_rest')}), the daemon "
            f"handling them {extra('daemon_cpu', 'daemon_wait')} (its CPU {extra('daemon_cpu')}, waiting for a "
            f"CPU {extra('daemon_wait')}), the client waiting for a CPU {extra('client_wait')}, waiting for the "
            f"group commit {extra('held')}, client GC {extra('client_gc')}, messaging and wake-ups "
            f"{extra('client_send', 'to_loop', 'to_client')} (the client sending {extra('client_send')}, on to "
            f"the loop {extra('to_loop')}, back to the client {extra('to_client')}); meanwhile the client's "
            f"ZeroMQ I/O thread waited for a CPU {extra('client_io_wait')}.\n"
            f"    tail in short: queueing behind other clients' work {extra('queue_cpu', 'queue_rest')}, the daemon's own work "
            f"on the message {extra('daemon_cpu')}, waiting for a CPU {extra('queue_wait', 'daemon_wait', 'client_wait')}, "
            f"messaging, wake-ups, commit and GC {extra(*wire)}")
