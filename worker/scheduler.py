"""Continuous batching whose every block decision is made by the manager, one message per step.

Two calls per step (the shape of nano-vllm's and vLLM v1's schedulers)::

    plan = scheduler.schedule()                 # StepPlan: sub-ops, what each is for, the batch
    results = block_manager.step(plan.ops)      # one round trip
    batch = plan.batch(results)                 # what runs: refused sequences left out
    outputs = draw_tokens(batch, runner.execute(batch), eos)  # [Output(request, token, sample)]
    done = scheduler.update(plan, results, outputs)  # Updated: the errored, the samples spawned

``schedule`` composes the message: forks, frees, then the running requests oldest first, then
allocs for waiting requests FCFS, all within the token budget. A running request gets an extend
only when its tokens need a block it does not hold, or after a fork (sparse steps, PROTOCOL.md
section 6); otherwise it runs in blocks it holds without a sub-op. ``update`` applies the
manager's answers (block tables, admissions, refusals), marks the tokens computed, appends the
sampled tokens, finishes requests, spawns an n > 1 request's other samples at its first token
(each a request of its own, with a new manager id), and preempts. Frees and forks decided in
``update`` travel at the head of the next message.

Overlap (the engine's default): ``schedule`` may run again before the previous plan's ``update``,
assuming each sequence of that plan yields a token (the requests' in-flight counters say what is
assumed). A request whose alloc or first sample of n > 1 is in flight sits that step out; an
extend built on a step in flight carries ``base``, so it is refused when that step was. ``update``
reconciles: entries of requests that finished, were aborted or preempted since no longer count,
and a request refused for space with its next step already sent is rewound (or preempted).
``admit_late`` admits the requests that arrived after a plan was answered into it, as a plan of
allocs of their own (one more message; worker/step_loop.py sends it).

Preemption by recompute: when the manager answers no_space to running requests' extends, the
newest running requests are preempted (the refused ones included) until the blocks they hold
cover the shortfall. A victim whose own sub-op succeeded still runs this step, because its new
blocks were entered into the prefix cache and must be computed; it is freed at the head of the
next message and re-queued at the front of the waiting queue, where its computed full blocks are
likely still cached. Admissions pause for one step after a preemption, a waiting request refused
for space blocks the ones behind it, and admissions stop while the blocks our requests hold leave
no block of growth per running request (a policy on our own holdings; which blocks, and whether
they fit, the manager decides). Those two flags are the only state one step leaves the next.

Owners: this class holds the policy (what a step does, what the outcome means for the next), the
flags and the manager's request ids; ``RunningSet`` (worker/running_set.py) the queues, the frees
and forks owed and the counters; a request's records change by their own methods
(worker/request.py, its ``kv`` view and ``step`` state); worker/step_outcome.py gives each answer
and each drawn token to its request; worker/scheduling_policy.py has the admission-room and
victim estimates. The EOS ids and the pool's size come in (constructor, ``set_pool_size``).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Collection

from kvpool.shared.step_ops import Alloc, Extend, Fork, Free, Result
from kvpool.worker.kv_view import cdiv
from kvpool.worker.request import Request
from kvpool.worker.running_set import RunningSet, SchedulerStats
from kvpool.worker.scheduling_policy import admission_room, choose_victims
from kvpool.worker.step_outcome import accept_tokens, apply_answers
from kvpool.worker.step_plan import Batch, BatchSeq, Output, ScheduledSeq, StepPlan, SubOp, Updated
from kvpool.worker.step_state import StepState

__all__ = ["Batch", "BatchSeq", "Output", "Scheduler", "SchedulerStats", "StepPlan", "Updated"]

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, *, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, static_prealloc: bool = False,
                 eos_token_ids: Collection[int] = (), num_blocks: int | None = None) -> None:
        self.block_size = block_size
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.caching = enable_prefix_caching and not static_prealloc
        self.chunked = enable_chunked_prefill
        self.static = static_prealloc
        self.eos_token_ids = frozenset(eos_token_ids)  # any of them ends a request ("stop")
        self.requests = RunningSet()
        self.num_blocks = num_blocks  # the pool's size, known at registration (admission room)
        self._rids = itertools.count()  # the manager's request ids (requests, parallel samples)
        self.hold_admissions = False  # a preemption happened: admit nobody next step
        self.head_blocked = False  # the head of the waiting queue was refused for space
        # The manager refused an admission for draining, and none has gone through since (with
        # overlap the refusal and the next plan's answers alternate: the flag spans them).
        self.drain_refused = False
        self._left_waiting = False  # the last plan left requests waiting (admit_late)

    # The running set's state, read-only here: RunningSet owns it and its changes.
    @property
    def waiting(self) -> deque[Request]:
        return self.requests.waiting

    @property
    def running(self) -> list[Request]:
        return self.requests.running

    @property
    def pending_frees(self) -> list[int]:
        return self.requests.pending_frees

    @property
    def stats(self) -> SchedulerStats:
        return self.requests.stats

    def add(self, req: Request) -> None:
        self.requests.add(req)

    def new_rid(self) -> int:
        """A manager request id no request of this scheduler has had."""
        return next(self._rids)

    def set_pool_size(self, num_blocks: int) -> None:
        """The pool registered (again) with ``num_blocks`` blocks."""
        self.num_blocks = num_blocks

    def has_work(self) -> bool:
        return self.requests.has_work()

    # -- composing the step message --------------------------------------------------------

    def _lookahead(self, num_tokens: int) -> int:
        return max(0, self.max_model_len - num_tokens) if self.static else 0

    def _new_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the blocks full once ``num_tokens`` are computed that the manager lacks."""
        if not self.caching:
            return []
        return req.hasher.hashes[req.kv.num_hashes_sent : num_tokens // self.block_size]

    def schedule(self) -> StepPlan:
        """The next step: its sub-ops and the sequences it runs (nothing changes but the
        requests' in-flight state, their manager views and the queues of frees and forks it sends)."""
        plan = StepPlan()
        forks, frees, computed = self.requests.take_pending()
        for parent, child in forks:
            self._fork(plan, parent, child)
        for rid in frees:
            plan.add(SubOp(Free(rid, computed.get(rid)), "free", None))
        budget = self._schedule_running(plan)
        if not self.hold_admissions:
            self._admit(plan, budget)
        self.hold_admissions = False
        self._left_waiting = bool(self.waiting)  # kept out this step: admit_late lets no one pass them
        StepState.launch(plan.seqs)  # each one's next step reads its in-flight counts before this
        return plan

    def admit_late(self, plan: StepPlan) -> StepPlan | None:
        """Overlap: requests that arrived after ``plan`` was composed (its answers are in, its
        batch has not run) admitted into what is left of its token budget and sequence slots, as
        a plan of their own (allocs) that ``plan.join`` appends once the manager answered it.
        None when nobody can join: no newcomer, admissions held after a preemption, the head of
        the queue refused for space or draining, or a request the plan itself left waiting (it
        was kept out by room, slots or budget, and no one overtakes it)."""
        if not self.waiting or self.hold_admissions or self.head_blocked or self.drain_refused or self._left_waiting:
            return None
        extra = StepPlan()
        self._admit(extra, self.token_budget - sum(s.num_tokens for s in plan.seqs))
        if not extra.seqs:
            return None
        StepState.launch(extra.seqs)
        return extra

    def _schedule_running(self, plan: StepPlan) -> int:
        """Schedules the running requests, oldest first, within the token budget; returns what
        is left of it. A request gets an extend only when its tokens need a block it does not
        hold (lookahead included) or a fork left it sharing a partial block; the hashes of blocks
        that became full ride along with that extend (PROTOCOL.md, "Sparse steps"). One loop,
        no call per request: it runs for every running request every step."""
        budget, seqs, static = self.token_budget, plan.seqs, self.static
        for req in self.running:
            st = req.step
            known = len(req.tokens) + st.num_pending_samples  # the last one may still be sampled
            start = st.num_computed + st.num_scheduled
            n = min(known - start, budget)
            if n == 0 or (st.admitting and not st.num_pending_samples) or \
                    (st.num_pending_samples and req.holds_all_samples):
                continue  # its next step depends on answers in flight (a chunk's cached count, forks)
            num_tokens = start + n
            lookahead = self._lookahead(num_tokens) if static else 0
            op = -1
            kv = req.kv
            if kv.must_sync or num_tokens + lookahead > kv.num_slots:
                op = self._extend(plan, req, num_tokens, lookahead, n)
            seqs.append(ScheduledSeq(req, st, st.generation, n, start, op, num_tokens == known))
            budget -= n
        return budget

    def _extend(self, plan: StepPlan, req: Request, num_tokens: int, lookahead: int, n: int) -> int:
        kv = req.kv
        hashes = self._new_hashes(req, num_tokens)
        # built on a step still in flight (num_scheduled): valid only if that one succeeded
        op = Extend(req.rid, num_tokens, hashes, lookahead, kv.synced_tokens if req.step.num_scheduled else None)
        slots = cdiv(num_tokens + lookahead, self.block_size) * self.block_size
        undo = kv.extend_sent(num_tokens, len(hashes), slots)
        return plan.add(SubOp(op, "extend" if n else "sync", req, req.step.generation, n, undo))

    def _fork(self, plan: StepPlan, parent: Request, child: Request) -> None:
        """The child shares the blocks of the parent's computed tokens: the manager's view of the
        parent is brought up to them first, and both must write through the manager next."""
        tokens = parent.step.num_computed
        if parent.kv.synced_tokens != tokens:
            self._extend(plan, parent, tokens, self._lookahead(tokens), 0)
        plan.add(SubOp(Fork(parent.rid, child.rid), "fork", child, child.step.generation))
        child.kv.fork_sent(parent.kv, tokens, self.block_size)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        if not self.waiting:
            return  # spares _room's walk over every running block table on a decode step
        slots = self.max_num_seqs - len(self.running)
        room, admitted = self._room(), []
        for req in self.waiting:
            n = min(len(req.tokens), budget)
            if slots <= 0 or n == 0 or (not self.chunked and n < len(req.tokens)):
                break
            blocks = cdiv(n + self._lookahead(n), self.block_size)
            room -= blocks
            if room < 0 and (self.running or admitted):
                break  # an idle pool still tries its head: the manager has the last word
            hashes = list(req.hasher.hashes) if self.caching else []
            alloc = Alloc(req.rid, hashes, len(req.tokens), n, self._lookahead(n), req.params.priority or None)
            op = plan.add(SubOp(alloc, "alloc", req, req.step.generation, n))
            sample = n == len(req.tokens)  # the whole prompt: computed after it, whatever is cached
            plan.seqs.append(ScheduledSeq(req, req.step, req.step.generation, n, 0, op, sample))
            req.kv.alloc_sent(n, blocks * self.block_size, len(hashes))  # at most what the manager gives
            admitted.append(req)
            budget -= n
            slots -= 1
            if self.head_blocked:
                break  # the head was refused for space: no one overtakes it
        self.requests.start(admitted)

    def _room(self) -> int:
        return admission_room(self.running, self.num_blocks, self.block_size, self.static, self.requests.num_held)

    # -- applying the outcome --------------------------------------------------------------

    def update(self, plan: StepPlan, results: list[Result], outputs: list[Output]) -> Updated:
        """Applies the manager's ``results`` for ``plan`` and the tokens sampled from its batch:
        the requests refused as bad input (they end with an error) and who took each token."""
        if len(results) != len(plan.ops):
            raise RuntimeError(f"manager answered {len(results)} results for {len(plan.ops)} sub-ops")
        answered = apply_answers(self.requests, plan, results, self.block_size)
        self.head_blocked = answered.head_refused  # no one overtakes it next step
        if answered.draining is not None:
            self.drain_refused = answered.draining
        self.requests.requeue(answered.refused)
        ran = [(s.step, start, n) for s, start, n, _ in plan.runnable(results)]
        victims = self._preempt_for(answered.failed) if answered.failed else []
        self.requests.settle(plan, ran)
        spawned = accept_tokens(self.requests, outputs, self.new_rid, self.eos_token_ids, self.max_model_len)
        for req in victims:  # the ones that ran this step: their blocks go back at the next
            if req in self.running:
                self.requests.preempt(req)
        self.requests.track_usage()
        return Updated(answered.errored, spawned)

    def _preempt_for(self, failed: list[tuple[Request, int]]) -> list[Request]:
        """Preempts newest-first until the blocks they hold cover what the refused requests
        lacked (scheduling_policy.choose_victims). Returns the victims that run this step
        (preempted after it)."""
        victims = choose_victims(self.running, failed, self.block_size)
        for req, n in failed:
            if req not in self.running:
                continue
            if req in victims:
                self.requests.preempt(req)  # it did not run this step: preempt it now
            elif req.step.num_scheduled > n:
                self.requests.rewind(req)
        self.hold_admissions = True
        return victims

    # -- state changes the next message carries (RunningSet makes them) ---------------------

    def finish(self, req: Request, reason: str) -> None:
        self.requests.finish(req, reason)

    def drop(self, req: Request) -> None:
        """Aborts ``req`` wherever it is; its blocks go back at the next step."""
        self.requests.drop(req)

    def spawn(self, parent: Request, child: Request) -> None:
        """A parallel sample sharing ``parent``'s computed blocks (forked at the next step)."""
        self.requests.spawn(parent, child)

    def abandon(self, plan: StepPlan) -> None:
        """The manager refused ``plan`` as a whole (nothing of it ran): its frees go out again,
        and every running request starts over, freeing whatever the manager holds for it (the
        plan's in-flight assumptions can no longer be reconciled)."""
        self.requests.abandon(op for op in plan.ops if type(op) is Free)

    def reset(self) -> list[Request]:
        """The manager lost every request: all recompute; returns them (running first)."""
        return self.requests.reset()

    def release_all(self) -> list[int]:
        """Shutdown: the request ids to free at the manager; the running set forgets them."""
        return self.requests.release_all()
