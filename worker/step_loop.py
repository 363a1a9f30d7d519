"""One engine step against the manager: schedule, send the step message, run, update.

    plain:       schedule N, send it, wait for the answer | run N, update N
    overlapped:  (N answered before) schedule N+1, send it | run N, update N | wait for N+1's answer

With ``overlap`` (the engine's default) step N+1's message goes to the manager before step N's
forward pass and is collected after it, so the round trip hides behind the compute
(``manager_wait_s`` counts the time a step still waited).

A request that arrives while step N computes would then join step N+2, one step later than a
synchronous scheduler (vLLM's on CPU) admits it. Two paths give it step N+1:

- After a step in which the last running requests ended, with nobody waiting, the next plan is
  composed after the forward pass (one round trip exposed, ``arrival_waits`` counts them): a
  client with a bounded number of requests open sends its next one when one ends.
- Otherwise step N+1's plan is already answered when step N ends; the requests that arrived meanwhile
  join it by a message of their own, their allocs in what is left of its token budget and sequence
  slots (``Scheduler.admit_late``; one round trip exposed, ``late_admissions`` counts them), so
  their prefill runs beside the running requests' next token, as a synchronous scheduler runs it.
  Not when the plan's answers carry tier copies (they run in the answers' order around the forward
  pass, and the newcomers' would come after them in the manager's decisions but before them in the
  batch), and never past a request the plan left waiting.

Measured with `vllm bench serve` against vLLM (scripts/bench_vs_vllm.py, 64 prompts, concurrency 8):
with arrivals joining step N+2 while others ran, a wave of clients whose requests ended together
waited one decode step more than vLLM's for its first tokens; joining N+1 brought the
shared-prefix mean TTFT from 1.09x vLLM's to 1.00x in one run serving all three side by side. An
earlier rule let only the arrivals after a finish join N+1 while others ran, the rest N+2: that
split each wave of arrivals into groups of two or three prefilled in different steps, each
group's prefill a long gap for every running request (ITL p99 92-129 ms against a 12 ms median);
admitting every arrival at the next step keeps a wave together as far as its arrivals are.

``StepLoop`` owns what one step leaves the next: the plan answered but not run yet (overlap), the
node-tier batches run but not yet told to the manager, whether the manager forgot our requests
(``ManagerReset``: the next step re-registers and every request is recomputed) and why the last
step stalled. Its one subclass, the engine (worker/engine.py), registers, runs a batch's forward
pass (``_run``) and turns what a step did into events (``_events``).
"""

from __future__ import annotations

import logging
import time

from kvpool.shared.node_orders import NodeReport
from kvpool.shared.protocol import ManagerError
from kvpool.worker.block_manager import BlockManager, ManagerReset
from kvpool.worker.live_requests import TokenEvent
from kvpool.worker.scheduler import Batch, Output, Scheduler, StepPlan, Updated

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, block_manager: BlockManager, scheduler: Scheduler, overlap: bool) -> None:
        self.bm = block_manager
        self.scheduler = scheduler
        self.overlap = overlap
        self.resets = 0
        self.generated_tokens = 0  # tokens drawn for requests (prefill and recompute are not counted)
        self.manager_wait_s = 0.0  # time a step spent blocked on the manager's answer
        self.arrival_waits = 0  # overlapped steps whose next plan waited for the forward pass
        self.late_admissions = 0  # overlapped steps that newcomers joined after their plan was answered
        # Why the last step made no progress ("draining": the manager refuses admissions), or None.
        # The serving loop backs off while it is set instead of resending the step at once.
        self.stalled: str | None = None
        self._lost = False
        self._ready: tuple[StepPlan, list[dict], Batch] | None = None  # overlap: answered, not run
        self._ran = False  # the last step ran a batch
        self._finished = False  # a request ended in the last step: its client may send the next one
        self._node_reports: list[NodeReport] = []  # node-tier batches run, not yet told to the manager

    # -- what the engine adds ----------------------------------------------------------------

    def register(self) -> None:
        """(Re-)registers with the manager."""
        raise NotImplementedError

    def _run(self, batch: Batch) -> list[Output]:
        """The forward pass over ``batch`` and the tokens it drew."""
        raise NotImplementedError

    def _events(self, outputs: list[Output], done: Updated) -> list[TokenEvent]:
        """The events of a step: its requests that ended with an error, the tokens drawn."""
        raise NotImplementedError

    # -- one step --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._lost or self._ready is not None or bool(self._node_reports)

    def step(self) -> list[TokenEvent]:
        """One scheduler step. Raises ManagerUnavailable while the manager cannot be reached to
        re-register (the caller retries later; requests wait, nothing is lost)."""
        if self._lost:
            self.register()
            self._lost = False
        self.stalled, self._ran = None, False
        events = self._step_overlapped() if self.overlap else self._step_plain()
        self.generated_tokens += sum(ev.token is not None for ev in events)
        self._finished = any(ev.finished for ev in events)
        if self.scheduler.drain_refused and not events and not self._ran:
            self.stalled = "draining"
        return events

    def _schedule_and_wait(self) -> tuple[StepPlan, list[dict]] | None:
        """Schedules a step and waits for the manager's answer to its ops: (plan, results), or
        None when there is nothing to do or the manager reset (the step is dropped)."""
        plan = self.scheduler.schedule()
        results = self._ask(plan)
        if results is None or (not plan.ops and not plan.seqs):
            return None
        return plan, results

    def _ask(self, plan: StepPlan) -> list[dict] | None:
        """Sends ``plan``'s ops (with the node reports owed) and waits for the answers; None when
        the manager reset (the step is dropped). A message refused whole starts every request
        over (``abandon``: ``plan``'s frees go out again) and raises."""
        try:
            ticket = self._send(plan.ops)
            return self._wait(ticket) if ticket is not None else []
        except ManagerReset as e:
            self._reset(e)
            return None
        except ManagerError:
            self.scheduler.abandon(plan)
            raise

    def _step_plain(self) -> list[TokenEvent]:
        asked = self._schedule_and_wait()
        if asked is None:
            return []
        plan, results = asked
        return self._run_plan(plan, results, plan.batch(results))

    def _step_overlapped(self) -> list[TokenEvent]:
        """Step N's batch runs while the manager answers step N+1's message, which was composed
        assuming every sequence of step N yields a token (``update`` reconciles: a request that
        finished frees its extra slot, one refused for space is preempted before it runs)."""
        sched = self.scheduler
        ready, self._ready = self._ready, None
        if ready is None:  # nothing in flight: ask for step N and wait
            asked = self._schedule_and_wait()
            if asked is None:
                return []
            plan, results = asked
            ready = (plan, results, plan.batch(results))
        else:
            ready = self._admit_late(*ready)
            if ready is None:
                return []
        plan, results, batch = ready
        if self._finished and not sched.waiting and not sched.running:  # N+1 composed after the forward
            self.arrival_waits += 1
            return self._run_plan(plan, results, batch)
        following = sched.schedule()  # step N+1
        try:
            ticket = self._send(following.ops)
        except ManagerReset as e:
            self._reset(e)
            return []
        except ManagerError:
            sched.abandon(following)  # step N's batch was made on it too: it starts over as well
            raise
        events = self._run_plan(plan, results, batch)
        try:
            answers = self._wait(ticket) if ticket is not None else []
        except ManagerReset as e:
            self._reset(e)
            return events
        except ManagerError as e:
            logger.warning("the manager refused a step (%s): its requests start over", e)
            sched.abandon(following)
            return events
        if following.ops or following.seqs:
            self._ready = (following, answers, following.batch(answers))
        return events

    def _admit_late(self, plan: StepPlan, results: list[dict], batch: Batch) -> tuple[StepPlan, list[dict], Batch] | None:
        """The requests that arrived while the step before computed join this answered plan
        (``Scheduler.admit_late``): one more round trip, exposed, for their allocs. Not when the
        plan's answers carry tier copies (host saves, loads or writes, a node batch): those run
        in the answers' order around the forward pass, and the newcomers' would come after them
        in the manager's decisions but before them in the batch. None: the manager reset."""
        if batch.saves or batch.loads or batch.writes or batch.node_batch is not None:
            return plan, results, batch
        extra = self.scheduler.admit_late(plan)
        if extra is None:
            return plan, results, batch
        answers = self._ask(extra)  # refused whole: every request starts over (plan ran at the manager)
        if answers is None:
            return None
        self.late_admissions += 1
        plan.join(extra)
        results = results + answers
        return plan, results, plan.batch(results)

    def _run_plan(self, plan: StepPlan, results: list[dict], batch: Batch) -> list[TokenEvent]:
        """Runs a plan's batch and applies its answers and tokens: the step's events."""
        outputs = self._run(batch)
        return self._events(outputs, self.scheduler.update(plan, results, outputs))

    # -- the manager's side ----------------------------------------------------------------

    def _send(self, ops: list) -> object | None:
        """Sends a step's ``ops`` with the node-tier batches run since the last message; with
        no ops, those reports alone (a node tier's saves land for other pools only once told)."""
        reports, self._node_reports = self._node_reports, []
        if ops:
            return self.bm.send_step(ops, reports) if reports else self.bm.send_step(ops)
        if reports:
            self.bm.node_done(reports)
        return None

    def _wait(self, ticket: object) -> list[dict]:
        start = time.perf_counter()
        try:
            return self.bm.recv_step(ticket)
        finally:
            self.manager_wait_s += time.perf_counter() - start

    def _reset(self, err: Exception) -> None:
        logger.warning("manager lost our requests (%s): re-registering, recomputing", err)
        self._ready = None
        self._node_reports = []  # the manager abandons the batches of a session it lost
        self.scheduler.reset()
        self.resets += 1
        self._lost = True
