"""A request's progress through the scheduler's steps: ``req.step``, the scheduler's own record.

``num_computed``: tokens whose K/V is in the cache. What the scheduler has asked for but not yet
seen answered (a step in flight, two with overlap): ``num_scheduled`` tokens,
``num_pending_samples`` tokens still to be sampled, ``admitting`` (an alloc). ``generation``
moves on whenever the request leaves the running set or loses its KV, so that the entries of
plans made before (worker/step_plan.py's ``ScheduledSeq`` and ``SubOp`` keep the generation they
saw) no longer count. ``in_running``: in the running set (worker/running_set.py counts its blocks).

Only the scheduler changes it (worker/scheduler.py, worker/step_outcome.py, worker/running_set.py),
each change one method here. The changes every step makes to every request it runs are made for
the whole plan at once (``launch``, ``land``: its hot path, a loop here rather than a call per
request).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Entry(Protocol):
    """What ``launch`` and ``land`` read of a plan's entry (worker/step_plan.py ``ScheduledSeq``)."""

    @property
    def step(self) -> StepState: ...

    @property
    def generation(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def sample(self) -> bool: ...


class StepState:
    __slots__ = ("num_computed", "num_scheduled", "num_pending_samples", "admitting", "generation",
                 "in_running", "num_preemptions")

    def __init__(self) -> None:
        self.num_computed = 0
        self.num_scheduled = 0
        self.num_pending_samples = 0
        self.admitting = False
        self.generation = 0
        self.in_running = False
        self.num_preemptions = 0

    # -- a step's life ------------------------------------------------------------------------

    @staticmethod
    def launch(entries: Iterable[Entry]) -> None:
        """A step is sent: each entry's ``num_tokens`` are in flight (and, with ``sample``, a
        token to be sampled after them)."""
        for e in entries:
            st = e.step
            st.num_scheduled += e.num_tokens
            st.num_pending_samples += e.sample

    @staticmethod
    def land(entries: Iterable[Entry], ran: Iterable[tuple[StepState, int, int]]) -> int:
        """A step is over: its entries are no longer in flight, unless their request moved on
        since it was sent (its counters then started over); ``ran``: (state, start, tokens) of
        each entry that ran, computed now. Returns the tokens computed."""
        for e in entries:
            st = e.step
            if st.generation == e.generation:
                st.num_scheduled -= e.num_tokens
                st.num_pending_samples -= e.sample
        total = 0
        for st, start, n in ran:
            st.num_computed = start + n
            total += n
        return total

    def rewind(self) -> None:
        """The steps in flight no longer count (refused, or built on a refused one)."""
        self.num_scheduled = self.num_pending_samples = 0
        self.generation += 1

    def move_on(self) -> None:
        """The request left (finished, aborted): entries of plans made before no longer count."""
        self.generation += 1

    # -- admissions, forks, losses ------------------------------------------------------------

    def start_admission(self) -> None:
        self.admitting = True

    def admitted(self, cached: int) -> None:
        """The manager answered the admission: ``cached`` tokens hit are computed already."""
        self.admitting = False
        self.num_computed = cached

    def refused(self) -> None:
        self.admitting = False

    def join(self) -> None:
        self.in_running = True

    def leave(self) -> None:
        self.in_running = False

    def share_progress(self, parent: StepState) -> None:
        """A new parallel sample has computed what its ``parent`` has (their blocks are shared)."""
        self.num_computed = parent.num_computed

    def reset(self, preempted: bool = False) -> None:
        """The KV is gone (preempted, lost, refused): recomputed from the first token."""
        self.num_computed = self.num_scheduled = self.num_pending_samples = 0
        self.admitting = False
        self.generation += 1
        self.num_preemptions += preempted
