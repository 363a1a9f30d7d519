"""The requests a scheduler holds and what it owes the manager for them: the running-set bookkeeping.

One owner for the queues (waiting, running), the frees and forks the next step message carries,
and the counters: the scheduler's policies (what to admit, whom to preempt, worker/scheduler.py
and worker/scheduling_policy.py) decide, and this class moves requests between the queues.

``running`` is in admission order, newest last (preemption takes the newest). ``waiting`` is
FCFS, with preempted and refused requests put back at its front.

It also counts the distinct blocks the running requests hold (``num_held``: the peak-usage
statistic and the admission room). Building that set every step walked every block table, a
tenth of the scheduler's time per step at 64-1,024 running requests (scripts/bench_sched.py).
The count is kept instead as entries per block, changed only where a table changes: a request
that joins or leaves the running set, and the manager's answers (``set_blocks``, ``add_blocks``).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from kvpool.shared.step_ops import Free
from kvpool.worker.request import Request
from kvpool.worker.step_plan import StepPlan
from kvpool.worker.step_state import StepState

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # tokens looked up by admissions
    cached_tokens: int = 0  # of which the manager found cached
    computed_tokens: int = 0
    peak_blocks: int = 0  # distinct blocks held by running requests, at the peak
    peak_running: int = 0


class RunningSet:
    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self.pending_frees: list[int] = []
        # rid -> tokens whose K/V was written when its free was decided (the free's ``computed``)
        self.computed_at_free: dict[int, int] = {}
        self.pending_forks: list[tuple[Request, Request]] = []  # (parent, child)
        self.stats = SchedulerStats()
        self._holders: dict[int, int] = {}  # block -> entries of it in running requests' tables

    # -- the blocks running requests hold --------------------------------------------------

    @property
    def num_held(self) -> int:
        """Distinct blocks in the running requests' block tables."""
        return len(self._holders)

    def set_blocks(self, req: Request, blocks: list[int]) -> None:
        """``req`` holds exactly ``blocks`` now (an admission or a fork answered; a child that
        finished before its fork was sent still gets its blocks, freed with the next message)."""
        if req.step.in_running:
            self._unhold(req.kv.block_table)
            self._hold(blocks)
        req.kv.set_table(blocks)

    def add_blocks(self, req: Request, blocks: list[int], copies: Iterable[tuple[int, int]]) -> None:
        """``req`` gains ``blocks``, and ``copies`` (index, new block) replace some of its blocks
        (copy-on-write)."""
        replaced = req.kv.add_blocks(blocks, copies)
        if req.step.in_running:
            self._hold(blocks)
            for old, dst in replaced:
                self._unhold((old,))
                self._hold((dst,))

    def check_held(self) -> None:
        """Raises AssertionError unless the count matches the block tables (tests)."""
        want = Counter(chain.from_iterable(r.kv.block_table for r in self.running))
        if want != self._holders:
            raise AssertionError(f"held-block count {len(self._holders)} != {len(want)} blocks in the tables")

    def _hold(self, blocks: Iterable[int]) -> None:
        h = self._holders
        for b in blocks:
            h[b] = h.get(b, 0) + 1

    def _unhold(self, blocks: Iterable[int]) -> None:
        h = self._holders
        for b in blocks:
            n = h[b] - 1
            if n:
                h[b] = n
            else:
                del h[b]

    def _join(self, req: Request) -> None:
        self.running.append(req)
        req.step.join()
        self._hold(req.kv.block_table)

    def _leave(self, req: Request) -> None:
        self.running.remove(req)
        req.step.leave()
        self._unhold(req.kv.block_table)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_frees)

    def take_pending(self) -> tuple[list[tuple[Request, Request]], list[int], dict[int, int]]:
        """The forks and frees the next step message carries, with the computed tokens of the
        freed requests; they are owed no more."""
        forks, frees, computed = self.pending_forks, self.pending_frees, self.computed_at_free
        self.pending_forks, self.pending_frees, self.computed_at_free = [], [], {}
        return forks, frees, computed

    def _owe_free(self, req: Request) -> None:
        """``req``'s blocks go back with the next message, which says how many of its tokens
        were computed: a step of it already answered (overlap) may never run now, and the
        manager must not keep hashes of blocks whose K/V that step was to write."""
        self.pending_frees.append(req.rid)
        self.computed_at_free[req.rid] = req.step.num_computed

    @staticmethod
    def _forget_kv(req: Request, preempted: bool = False) -> None:
        """``req`` holds nothing at the manager any more: recomputed from its first token, and
        the entries of plans made before no longer count."""
        req.kv.reset()
        req.step.reset(preempted)

    # -- admissions ------------------------------------------------------------------------

    def start(self, admitted: list[Request]) -> None:
        """``admitted`` (the head of the waiting queue, in order) run from now on; a refusal
        puts one back in front (``requeue``)."""
        for req in admitted:
            self.waiting.popleft()
            req.step.start_admission()
            self._join(req)

    def withdraw(self, req: Request) -> None:
        """An admission the manager refused: out of the running set, its KV state forgotten (a
        step built on this admission, with overlap, no longer counts)."""
        self._leave(req)
        self._forget_kv(req)

    def requeue(self, refused: list[Request]) -> None:
        """Refused admissions back at the front of the waiting queue, in their order."""
        for req in reversed(refused):
            self.waiting.appendleft(req)

    def count_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens += cached_tokens

    # -- after a step ----------------------------------------------------------------------

    def settle(self, plan: StepPlan, ran: list[tuple[StepState, int, int]]) -> None:
        """The plan's sequences are no longer in flight; the ones that ran, (state, start,
        tokens), are computed."""
        self.stats.computed_tokens += StepState.land(plan.seqs, ran)

    def rewind(self, req: Request) -> None:
        """``req`` was refused while its next step was already sent (overlap): that one carries
        a ``base`` the manager no longer matches, so it is refused too and changes nothing; the
        request keeps its blocks and retries from its computed tokens."""
        req.step.rewind()  # the in-flight step's entries no longer count

    def track_usage(self) -> None:
        s = self.stats
        s.steps += 1
        s.peak_running = max(s.peak_running, sum(not r.step.admitting for r in self.running))
        s.peak_blocks = max(s.peak_blocks, len(self._holders))

    def preempt(self, req: Request) -> None:
        self._leave(req)
        self._owe_free(req)
        self._forget_kv(req, preempted=True)
        self.stats.preemptions += 1
        self.waiting.appendleft(req)  # newest preempted first, so the oldest ends up in front
        logger.info("preempted %r", req)

    def lose(self, req: Request) -> None:
        """The manager refused ``req`` for bad input: recompute it from scratch. Its free tells
        the manager to drop whatever it may still hold (unknown_request when nothing)."""
        if req not in self.running:
            return  # already lost (a refused fork, then its refused extend)
        self._leave(req)
        self._owe_free(req)
        self._forget_kv(req)
        self.waiting.appendleft(req)

    # -- state changes the next message carries --------------------------------------------

    def finish(self, req: Request, reason: str) -> None:
        req.finish(reason)
        req.step.move_on()
        self._leave(req)
        self._owe_free(req)

    def drop(self, req: Request) -> None:
        """Aborts ``req`` wherever it is; its blocks go back at the next step."""
        req.step.move_on()
        if req in self.waiting:
            self.waiting.remove(req)  # a preempted one's free is already pending
            return
        if req not in self.running:
            return
        if req.finish_reason is None:
            req.finish("abort")
        self._leave(req)
        forks = [(p, c) for p, c in self.pending_forks if c is not req]
        if len(forks) < len(self.pending_forks):
            self.pending_forks = forks  # never forked: the manager holds nothing for it
        else:
            self._owe_free(req)

    def spawn(self, parent: Request, child: Request) -> None:
        """A parallel sample sharing ``parent``'s computed blocks (forked at the next step)."""
        child.step.share_progress(parent.step)  # what the manager knows of it comes with the fork
        self._join(child)
        self.pending_forks.append((parent, child))

    def abandon(self, frees: Iterable[Free]) -> None:
        """The manager refused a whole step (nothing of it ran): its ``frees`` (the sub-ops) go
        out again, and every running request starts over, freeing whatever the manager holds
        for it."""
        frees = list(frees)
        self.pending_frees[:0] = [op.req for op in frees]  # type: ignore[misc]
        self.computed_at_free.update((op.req, op.computed) for op in frees if op.computed is not None)
        self.pending_forks = []
        for req in reversed(list(self.running)):
            self.lose(req)

    def reset(self) -> list[Request]:
        """The manager lost every request: all recompute; returns them (running first)."""
        lost = list(self.running)
        for req in reversed(lost):
            self.lose(req)
        self.pending_frees, self.pending_forks, self.computed_at_free = [], [], {}
        return lost

    def release_all(self) -> list[int]:
        """Shutdown: the ids of every request the manager holds blocks for (running, then the
        frees still owed), forgotten here from now on; the caller frees them at the manager or
        leaves them to its session timeout. Waiting requests hold nothing and stay queued."""
        rids = [r.rid for r in self.running] + self.pending_frees
        for r in self.running:
            r.step.leave()
        self.running, self.pending_frees, self.pending_forks = [], [], []
        self._holders = {}
        return rids
