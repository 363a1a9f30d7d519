"""Adaptive busy-polling for the manager loop: a steady stream of steps never pays a wakeup.

A daemon that sleeps in ``poll`` between messages pays, for every message, the kernel waking
its thread (and, after sleeping, cold caches): about half of a small step's round trip over
ipc on the machines measured (docs/operating.md, *Busy polling*). So after a busy iteration
the loop polls without blocking for up to ``window_s`` before it sleeps again.

Adaptive, so an idle or sparsely used daemon sleeps as before and costs no CPU: after
``MAX_MISSES`` windows in a row that ended with no message (the stream's gaps are longer than
the window), the loop stops spinning; it starts again once a message arrives within
``window_s`` of the previous busy iteration's end (the gaps shrank). A window is only opened
after a busy iteration, so a daemon with no traffic never spins at all.

Why it also backs off under CPU contention: on a machine with fewer free cores than runnable
processes, a spinning daemon uses up its share of the CPU and is then preempted for a whole
scheduler slice, while a sleeping one is woken ahead of the running tasks, and its spinning
takes the core its own clients need: the median gets no better and the tail gets worse
(measured: docs/operating.md). Every CHECK_EVERY windows it reads how long it waited for a CPU
while runnable (Linux schedstat); above MAX_CPU_WAIT of the elapsed time it sleeps in poll for BACKOFF_S,
twice as long after each further contended check (up to MAX_BACKOFF_S), so on a machine that
stays busy it tries again rarely. Spinning is for a node with a core to spare, which a
dedicated manager has.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_pause = time.sleep  # bound at import: sleep(0) only releases the GIL (and a test's patched sleep is not ours)
MAX_MISSES = 4  # empty windows in a row before the loop stops spinning
CHECK_EVERY = 16  # windows between two looks at the CPU wait (/proc/self/schedstat)
MAX_CPU_WAIT = 0.05  # waiting for a CPU more than this share of the time: the cores are contended
BACKOFF_S = 2.0  # then no spinning for this long, doubled while the contention lasts
MAX_BACKOFF_S = 64.0


class BusyPoll:
    """Owns the spin state of one loop; ``window_s == 0`` turns it off."""

    __slots__ = ("window_s", "hits", "misses", "spin_s", "backoffs", "_deadline", "_streak", "_idle_since",
                 "_windows", "_since", "_cpu_wait0", "_backoff_until", "_backoff_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.hits = 0  # messages found while spinning (a wakeup saved)
        self.misses = 0  # windows that ended empty
        self.spin_s = 0.0  # wall time spent spinning
        self._deadline = 0.0  # perf_counter time the open window ends; 0: none open
        self._streak = 0  # empty windows in a row
        self._idle_since = 0.0  # end of the last busy iteration
        self.backoffs = 0  # times spinning stopped for BACKOFF_S because the cores were contended
        self._windows = 0  # windows since the last CPU-wait check
        self._since, self._cpu_wait0 = time.perf_counter(), cpu_wait_s()
        self._backoff_until = 0.0
        self._backoff_s = BACKOFF_S  # the next back-off's length

    @property
    def spinning(self) -> bool:
        """False while suspended (the last MAX_MISSES windows were empty) or off."""
        return self.window_s > 0 and self._streak < MAX_MISSES and time.perf_counter() >= self._backoff_until

    def wait(self, ready: Callable[[], bool]) -> bool:
        """Polls ``ready`` until the open window ends; True as soon as it says a message is there.
        False at once when no window is open: the caller then blocks as usual."""
        deadline = self._deadline
        if not deadline:
            return False
        self._deadline = 0.0
        clock, pause = time.perf_counter, _pause
        start = now = clock()
        while now < deadline:
            pause(0)  # lets the process's other threads (metrics, CURVE's ZAP) take the GIL
            if ready():
                self.hits += 1
                self._streak = 0
                self.spin_s += clock() - start
                return True
            now = clock()
        self.misses += 1
        self._streak += 1
        self.spin_s += now - start
        return False

    def busy(self, arrived: float, done: float) -> None:
        """A busy iteration whose first message was ready at ``arrived`` ended at ``done``
        (perf_counter times): opens the next window unless spinning is suspended, and resumes
        spinning when this message came within a window of the previous iteration's end."""
        if self.window_s <= 0:
            return
        if self._streak >= MAX_MISSES and arrived - self._idle_since <= self.window_s:
            self._streak = 0
        self._idle_since = done
        if self._streak < MAX_MISSES and done >= self._backoff_until:
            self._deadline = done + self.window_s
            if not self._windows:  # the CPU wait is measured over spinning time only
                self._since, self._cpu_wait0 = done, cpu_wait_s()
            self._windows += 1
            if self._windows >= CHECK_EVERY:
                self._check_contention(done)

    def _check_contention(self, now: float) -> None:
        wait = cpu_wait_s()
        if wait is not None and self._cpu_wait0 is not None and wait - self._cpu_wait0 > MAX_CPU_WAIT * (now - self._since):
            self._backoff_until = now + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
            self._deadline = 0.0
            self.backoffs += 1
        else:
            self._backoff_s = BACKOFF_S
        self._windows = 0

    def snapshot(self) -> dict:
        return {"window_us": round(self.window_s * 1e6), "spinning": self.spinning, "hits": self.hits,
                "misses": self.misses, "spin_s": self.spin_s, "backoffs": self.backoffs}


def cpu_wait_s() -> float | None:
    """Seconds this process has waited for a CPU while runnable (Linux schedstat), else None."""
    try:
        with open("/proc/self/schedstat", "rb") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
