"""Continuous batching whose every block decision is made by the manager, one message per step.

Two calls per step (the shape of nano-vllm's and vLLM v1's schedulers)::

    plan = scheduler.schedule()                 # StepPlan: sub-ops, what each is for, the batch
    results = block_manager.step(plan.ops)      # one round trip
    batch = plan.batch(results)                 # what runs: refused sequences left out
    outputs = sample(runner.execute(batch))     # [(request, token, parent or None)]
    errored = scheduler.update(plan, results, outputs)

``schedule`` composes the message: forks, frees, then the running requests oldest first, then
allocs for waiting requests FCFS, all within the token budget. A running request gets an extend
only when its tokens need a block it does not hold, or after a fork (sparse steps, PROTOCOL.md
section 6); otherwise it runs in blocks it holds without a sub-op. ``update`` applies the
manager's answers (block tables, admissions, refusals), marks the tokens computed, appends the
sampled tokens, finishes and spawns requests, and preempts. Frees and forks decided in ``update``
travel at the head of the next message.

Overlap (the engine's default): ``schedule`` may run again before the previous plan's ``update``,
assuming each sequence of that plan yields a token (the requests' in-flight counters say what is
assumed). A request whose alloc or first sample of n > 1 is in flight sits that step out; an
extend built on a step in flight carries ``base``, so it is refused when that step was. ``update``
reconciles: entries of requests that finished, were aborted or preempted since no longer count,
and a request refused for space with its next step already sent is rewound (or preempted).

Preemption by recompute: when the manager answers no_space to running requests' extends, the
newest running requests are preempted (the refused ones included) until the blocks they hold
cover the shortfall. A victim whose own sub-op succeeded still runs this step, because its new
blocks were entered into the prefix cache and must be computed; it is freed at the head of the
next message and re-queued at the front of the waiting queue, where its computed full blocks are
likely still cached. Admissions pause for one step after a preemption, a waiting request refused
for space blocks the ones behind it, and admissions stop while the blocks our requests hold leave
no block of growth per running request (a policy on our own holdings; which blocks, and whether
they fit, the manager decides). Those two flags are the only state one step leaves the next.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from kvpool.worker.request import Request
from kvpool.worker.step_plan import Batch, BatchSeq, ScheduledSeq, StepPlan, SubOp

__all__ = ["Batch", "BatchSeq", "Output", "Scheduler", "SchedulerStats", "StepPlan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Output:
    """A sampled token; ``parent``: the request a new parallel sample ``req`` forks from."""

    req: Request
    token: int
    parent: Request | None = None
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # tokens looked up by admissions
    cached_tokens: int = 0  # of which the manager found cached
    computed_tokens: int = 0
    peak_blocks: int = 0  # distinct blocks held by running requests, at the peak
    peak_running: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, *, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, static_prealloc: bool = False,
                 eos_token_ids: Collection[int] = ()) -> None:
        self.block_size = block_size
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.caching = enable_prefix_caching and not static_prealloc
        self.chunked = enable_chunked_prefill
        self.static = static_prealloc
        self.eos_token_ids = frozenset(eos_token_ids)  # any of them ends a request ("stop")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self.pending_frees: list[int] = []
        self.pending_forks: list[tuple[Request, Request]] = []  # (parent, child)
        self.stats = SchedulerStats()
        self.num_blocks: int | None = None  # the pool's size, set at registration (admission room)
        self.hold_admissions = False  # a preemption happened: admit nobody next step
        self.head_blocked = False  # the head of the waiting queue was refused for space
        # The manager refused an admission for draining, and none has gone through since (with
        # overlap the refusal and the next plan's answers alternate: the flag spans them).
        self.drain_refused = False

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_frees)

    # -- composing the step message --------------------------------------------------------

    def _lookahead(self, num_tokens: int) -> int:
        return max(0, self.max_model_len - num_tokens) if self.static else 0

    def _new_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the blocks full once ``num_tokens`` are computed that the manager lacks."""
        if not self.caching:
            return []
        return req.hasher.hashes[req.num_hashes_sent : num_tokens // self.block_size]

    def schedule(self) -> StepPlan:
        """The next step: its sub-ops and the sequences it runs (nothing changes but the
        requests' in-flight counters and the queues of frees and forks it sends)."""
        plan = StepPlan()
        for parent, child in self.pending_forks:
            self._fork(plan, parent, child)
        for rid in self.pending_frees:
            plan.add({"op": "free", "req": rid}, SubOp("free", None))
        self.pending_forks, self.pending_frees = [], []
        budget = self.token_budget
        for req in self.running:
            n = min(req.num_remaining, budget)
            if n == 0 or (req.admitting and not req.num_pending_samples) or (req.num_pending_samples and not req.forked):
                continue  # its next step depends on answers in flight (a chunk's cached count, forks)
            self._schedule_running(plan, req, n)
            budget -= n
        if not self.hold_admissions:
            self._admit(plan, budget)
        self.hold_admissions = False
        return plan

    def _schedule_running(self, plan: StepPlan, req: Request, n: int) -> None:
        """Schedules ``n`` more tokens of ``req``; an extend only when they need a block it does
        not hold (lookahead included) or a fork left it sharing a partial block. The hashes of
        blocks that became full ride along with that extend (PROTOCOL.md, "Sparse steps")."""
        start = req.num_computed + req.num_scheduled
        num_tokens = start + n
        lookahead = self._lookahead(num_tokens)
        op = -1
        if req.must_sync or num_tokens + lookahead > req.num_slots:
            op = self._extend(plan, req, num_tokens, lookahead, n)
        sample = num_tokens == len(req.tokens) + req.num_pending_samples
        plan.seqs.append(ScheduledSeq(req, req.generation, n, start, op, sample))
        req.num_scheduled += n
        req.num_pending_samples += sample

    def _extend(self, plan: StepPlan, req: Request, num_tokens: int, lookahead: int, n: int) -> int:
        hashes = self._new_hashes(req, num_tokens)
        undo = (req.num_hashes_sent, req.synced_tokens, req.num_slots)
        op = {"op": "extend", "req": req.rid, "num_tokens": num_tokens, "hashes": hashes, "lookahead": lookahead}
        if req.num_scheduled:  # built on a step still in flight: valid only if that one succeeded
            op["base"] = req.synced_tokens
        index = plan.add(op, SubOp("extend" if n else "sync", req, req.generation, n, undo))
        req.num_hashes_sent += len(hashes)
        req.synced_tokens = num_tokens
        req.num_slots = max(req.num_slots, _cdiv(num_tokens + lookahead, self.block_size) * self.block_size)
        return index

    def _fork(self, plan: StepPlan, parent: Request, child: Request) -> None:
        """The child shares the blocks of the parent's computed tokens: the manager's view of the
        parent is brought up to them first, and both must write through the manager next."""
        tokens = parent.num_computed
        if parent.synced_tokens != tokens:
            self._extend(plan, parent, tokens, self._lookahead(tokens), 0)
        plan.add({"op": "fork", "req": parent.rid, "child": child.rid}, SubOp("fork", child, child.generation))
        child.synced_tokens = tokens
        child.num_slots = _cdiv(tokens, self.block_size) * self.block_size
        child.num_hashes_sent = min(parent.num_hashes_sent, tokens // self.block_size)
        parent.must_sync = child.must_sync = True

    def _admit(self, plan: StepPlan, budget: int) -> None:
        if not self.waiting:
            return  # spares _room's walk over every running block table on a decode step
        slots = self.max_num_seqs - len(self.running)
        room, admitted = self._room(), []
        for req in self.waiting:
            n = min(len(req.tokens), budget)
            if slots <= 0 or n == 0 or (not self.chunked and n < len(req.tokens)):
                break
            blocks = _cdiv(n + self._lookahead(n), self.block_size)
            room -= blocks
            if room < 0 and (self.running or admitted):
                break  # an idle pool still tries its head: the manager has the last word
            hashes = list(req.hasher.hashes) if self.caching else []
            op = plan.add({"op": "alloc", "req": req.rid, "hashes": hashes, "prompt_len": len(req.tokens),
                           "max_new": n, "lookahead": self._lookahead(n)}, SubOp("alloc", req, req.generation, n))
            sample = n == len(req.tokens)  # the whole prompt: computed after it, whatever is cached
            plan.seqs.append(ScheduledSeq(req, req.generation, n, 0, op, sample))
            req.num_slots = blocks * self.block_size  # at most what the manager gives
            req.synced_tokens = n
            req.num_hashes_sent = len(hashes)
            req.num_scheduled, req.num_pending_samples = n, int(sample)
            admitted.append(req)
            budget -= n
            slots -= 1
            if self.head_blocked:
                break  # the head was refused for space: no one overtakes it
        for req in admitted:  # running from now on; a refusal puts it back in front
            self.waiting.popleft()
            req.admitting = True
            self.running.append(req)

    def _room(self) -> int:
        """Blocks an admission may take and still leave every running request one block to
        grow into: an estimate from the blocks our requests hold (cache hits not counted), so
        admissions stop before decodes start to preempt. The manager still decides. Statically
        preallocated requests hold their whole max_model_len already and never grow."""
        if self.num_blocks is None:
            return 1 << 62
        held = len({b for r in self.running for b in r.block_table})
        held += sum(r.num_slots // self.block_size for r in self.running if r.admitting)  # answers in flight
        growth = 0 if self.static else len(self.running)
        return self.num_blocks - 1 - held - growth

    # -- applying the outcome --------------------------------------------------------------

    def update(self, plan: StepPlan, results: list[dict], outputs: list[Output]) -> list[Request]:
        """Applies the manager's ``results`` for ``plan`` and the tokens sampled from its batch;
        returns the requests refused as bad input (they end with an error)."""
        if len(results) != len(plan.ops):
            raise RuntimeError(f"manager answered {len(results)} results for {len(plan.ops)} sub-ops")
        errored: list[Request] = []
        failed: list[tuple[Request, int]] = []  # (request, tokens) refused for space
        refused_admissions: list[Request] = []
        self.head_blocked = False
        head = next((sub.req for sub in plan.subops if sub.kind == "alloc"), None)  # the queue's head
        for sub, res in zip(plan.subops, results):
            req = sub.req
            if req is not None and req.generation != sub.generation:
                continue  # it moved on (finished, aborted, lost) after the plan was made
            if sub.kind == "free":
                if not res.get("ok") and res.get("code") != "unknown_request":
                    logger.warning("free refused: %s", res)
            elif sub.kind == "fork":
                self._apply_fork(req, res)
            elif sub.kind in ("extend", "sync"):
                self._apply_extend(sub, res, failed)
            elif not self._apply_alloc(sub, res, refused_admissions):
                errored.append(req)
            elif res.get("code") == "no_space" and req is head:
                self.head_blocked = True
        for req in reversed(refused_admissions):
            self.waiting.appendleft(req)
        ran = [(s.req, start, n) for s, start, n, _ in plan.runnable(results)]
        victims = self._choose_victims(failed) if failed else []
        self._settle(plan, ran)
        for out in outputs:
            self._accept(out)
        for req in victims:  # the ones that ran this step: their blocks go back at the next
            if req in self.running:
                self._preempt(req)
        self._track_usage()
        return errored

    def _apply_fork(self, child: Request, res: dict) -> None:
        if res.get("ok"):
            child.block_table = list(res["blocks"])
            child.num_slots = len(child.block_table) * self.block_size
        else:
            logger.warning("fork of %r refused (%s): recomputing it", child, res.get("msg"))
            self._lose(child)

    def _apply_extend(self, sub: SubOp, res: dict, failed: list) -> None:
        req = sub.req
        if res.get("ok"):
            req.block_table.extend(res["blocks"])
            for index, _, dst in res["copies"]:
                req.block_table[index] = dst
            req.num_slots = max(req.num_slots, len(req.block_table) * self.block_size)
            req.must_sync = req.must_sync and sub.kind == "sync"  # a write went through: copied
            return
        req.num_hashes_sent, req.synced_tokens, req.num_slots = sub.undo
        if res.get("code") == "no_space":
            failed.append((req, sub.num_tokens))
        else:
            logger.warning("extend of %r refused (%s): recomputing it", req, res.get("msg"))
            self._lose(req)

    def _apply_alloc(self, sub: SubOp, res: dict, refused: list[Request]) -> bool:
        """False: refused as bad input."""
        req = sub.req
        req.admitting = False
        if res.get("ok"):
            self.drain_refused = False  # admissions go through again
            cached = res["cached"]  # a later step in flight may have moved the counts on: max
            req.num_computed, req.block_table = cached, list(res["blocks"])
            req.num_slots = max(req.num_slots, len(req.block_table) * self.block_size)
            req.synced_tokens = max(req.synced_tokens, cached + min(len(req.tokens) - cached, sub.num_tokens))
            self.stats.prompt_tokens += len(req.tokens)
            self.stats.cached_tokens += cached
            return True
        self.running.remove(req)
        req.reset_kv()  # a step built on this admission (overlap) no longer counts
        if res.get("code") in ("no_space", "draining"):
            self.drain_refused = self.drain_refused or res.get("code") == "draining"
            refused.append(req)
            return True
        req.finish_reason = f"error: {res.get('msg', res.get('code'))}"
        return False

    def _blocks_short(self, req: Request, n: int) -> int:
        return max(0, _cdiv(req.num_computed + n, self.block_size) - len(req.block_table))

    def _choose_victims(self, failed: list[tuple[Request, int]]) -> list[Request]:
        """Preempts newest-first until the blocks they hold cover what the refused requests
        lacked (an estimate: the manager stays the judge, a shortfall fails again next step).
        Returns the victims that run this step (preempted after it)."""
        short = {req: self._blocks_short(req, n) for req, n in failed}
        need = sum(short.values())
        victims = []
        for victim in reversed(list(self.running)):
            if need <= 0:
                break
            victims.append(victim)
            need -= len(victim.block_table) + short.get(victim, 0)
        for req, n in failed:
            if req not in self.running:
                continue
            if req in victims:
                self._preempt(req)  # it did not run this step: preempt it now
            elif req.num_scheduled > n:
                self._rewind(req)
        self.hold_admissions = True
        return victims

    def _rewind(self, req: Request) -> None:
        """``req`` was refused while its next step was already sent (overlap): that one carries
        a ``base`` the manager no longer matches, so it is refused too and changes nothing; the
        request keeps its blocks and retries from its computed tokens."""
        req.num_scheduled = req.num_pending_samples = 0
        req.generation += 1  # the in-flight step's entries no longer count

    def _settle(self, plan: StepPlan, ran: list[tuple[Request, int, int]]) -> None:
        """The plan's sequences are no longer in flight; the ones that ran are computed."""
        for s in plan.seqs:
            req = s.req
            if req.generation == s.generation:
                req.num_scheduled -= s.num_tokens
                req.num_pending_samples -= s.sample
        for req, start, n in ran:
            req.num_computed = start + n
            self.stats.computed_tokens += n

    def _accept(self, out: Output) -> None:
        req = out.req
        if out.parent is not None:
            self.spawn(out.parent, req)
        elif req.finish_reason is not None:
            return  # aborted while its step ran
        req.append(out.token)
        reason = None
        if out.token in self.eos_token_ids and not req.params.ignore_eos:
            reason = "stop"
        elif out.token in req.params.stop_token_ids:
            reason = "stop"
        elif req.num_output >= req.params.max_tokens or len(req.tokens) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.finish(req, reason)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pending_frees.append(req.rid)
        req.reset_kv()
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)  # newest preempted first, so the oldest ends up in front
        logger.info("preempted %r", req)

    def _lose(self, req: Request) -> None:
        """The manager refused ``req`` for bad input: recompute it from scratch. Its free tells
        the manager to drop whatever it may still hold (unknown_request when nothing)."""
        if req not in self.running:
            return  # already lost (a refused fork, then its refused extend)
        self.running.remove(req)
        self.pending_frees.append(req.rid)
        req.reset_kv()
        self.waiting.appendleft(req)

    def _track_usage(self) -> None:
        s = self.stats
        s.steps += 1
        s.peak_running = max(s.peak_running, sum(not r.admitting for r in self.running))
        blocks = {b for r in self.running for b in r.block_table}
        s.peak_blocks = max(s.peak_blocks, len(blocks))

    # -- state changes the next message carries --------------------------------------------

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.generation += 1
        self.running.remove(req)
        self.pending_frees.append(req.rid)

    def drop(self, req: Request) -> None:
        """Aborts ``req`` wherever it is; its blocks go back at the next step."""
        req.generation += 1
        if req in self.waiting:
            self.waiting.remove(req)  # a preempted one's free is already pending
            return
        if req not in self.running:
            return
        req.finish_reason = req.finish_reason or "abort"
        self.running.remove(req)
        forks = [(p, c) for p, c in self.pending_forks if c is not req]
        if len(forks) < len(self.pending_forks):
            self.pending_forks = forks  # never forked: the manager holds nothing for it
        else:
            self.pending_frees.append(req.rid)

    def spawn(self, parent: Request, child: Request) -> None:
        """A parallel sample sharing ``parent``'s computed blocks (forked at the next step)."""
        child.num_computed = parent.num_computed
        child.num_hashes_sent = parent.num_hashes_sent
        self.running.append(child)
        self.pending_forks.append((parent, child))

    def abandon(self, plan: StepPlan) -> None:
        """The manager refused ``plan`` as a whole (nothing of it ran): its frees go out again,
        and every running request starts over, freeing whatever the manager holds for it (the
        plan's in-flight assumptions can no longer be reconciled)."""
        self.pending_frees[:0] = [op["req"] for op in plan.ops if op["op"] == "free"]
        self.pending_forks = []
        for req in reversed(list(self.running)):
            self._lose(req)

    def reset(self) -> list[Request]:
        """The manager lost every request: all recompute; returns them (running first)."""
        lost = list(self.running)
        for req in reversed(lost):
            self._lose(req)
        self.pending_frees, self.pending_forks = [], []
        return lost
