"""Continuous batching whose every block decision is made by the manager, one message per step.

A step is: ``schedule()`` composes the step's sub-ops (forks, frees, then one extend per running
request oldest first, then allocs for waiting requests FCFS, all within the token budget);
the engine sends them in ONE step message; ``commit(results)`` turns the answers into a
``StepPlan`` for the runner; after the forward pass ``advance()`` marks the tokens computed, the
engine samples and calls ``finish``/``spawn``, and ``end_step()`` preempts this step's victims.
Frees and forks decided during a step travel at the head of the next message.

Preemption by recompute: when the manager answers no_space to running requests' extends, the
newest running requests are preempted (the refused ones included) until the blocks they hold
cover the shortfall. A victim whose own sub-op
succeeded still runs this step, because its new blocks were entered into the prefix cache and
must be computed; it is freed at the head of the next message and re-queued at the front of the
waiting queue, where its computed full blocks are likely still cached. Admissions pause for one
step after a preemption, a waiting request refused for space blocks the ones behind it, and
admissions stop while the blocks our requests hold leave no block of growth per running request
(a policy on our own holdings; which blocks, and whether they fit, the manager decides).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvpool.worker.request import Request

logger = logging.getLogger(__name__)


@dataclass
class SeqPlan:
    """One sequence's share of a step: plain data, so a step plan can be broadcast to TP ranks."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0] (tokens before it are in the cache)
    block_table: list[int]
    sample: bool  # the step reaches the sequence's last known token: sample the next one


@dataclass
class StepPlan:
    seqs: list[SeqPlan] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # tokens looked up by admissions
    cached_tokens: int = 0  # of which the manager found cached
    computed_tokens: int = 0
    peak_blocks: int = 0  # distinct blocks held by running requests, at the peak
    peak_running: int = 0


class Scheduler:
    def __init__(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, *, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, static_prealloc: bool = False) -> None:
        self.block_size = block_size
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.caching = enable_prefix_caching and not static_prealloc
        self.chunked = enable_chunked_prefill
        self.static = static_prealloc
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self.pending_frees: list[int] = []
        self.pending_forks: list[tuple[Request, Request]] = []  # (parent, child)
        self.stats = SchedulerStats()
        self.num_blocks: int | None = None  # the pool's size, set at registration (admission room)
        self.errored: list[Request] = []  # refused by the manager for bad input; engine reports
        self._actions: list[tuple[str, Request | None, int]] = []
        self._scheduled: list[tuple[Request, int]] = []
        self._victims: list[Request] = []
        self._hold_admissions = False
        self._head_blocked = False
        self.drain_refused = False  # the last step's admissions were refused: the manager drains

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_frees)

    # -- composing the step message --------------------------------------------------------

    def _lookahead(self, num_tokens: int) -> int:
        return max(0, self.max_model_len - num_tokens) if self.static else 0

    def _new_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        if not self.caching:
            return []
        return req.hasher.hashes[req.num_hashes_sent : num_tokens // self.block_size]

    def schedule(self) -> list[dict]:
        """The sub-ops of the next step message (remembered for ``commit``)."""
        ops: list[dict] = []
        acts = self._actions = []
        for parent, child in self.pending_forks:
            ops.append({"op": "fork", "req": parent.rid, "child": child.rid})
            acts.append(("fork", child, 0))
        for rid in self.pending_frees:
            ops.append({"op": "free", "req": rid})
            acts.append(("free", None, 0))
        self.pending_forks, self.pending_frees = [], []
        budget = self.token_budget
        for req in self.running:
            n = min(req.num_remaining, budget)
            if n == 0:
                continue
            num_tokens = req.num_computed + n
            ops.append({"op": "extend", "req": req.rid, "num_tokens": num_tokens,
                        "hashes": self._new_hashes(req, num_tokens),
                        "lookahead": self._lookahead(num_tokens)})
            acts.append(("extend", req, n))
            budget -= n
        if not self._hold_admissions:
            self._admit(ops, budget)
        self._hold_admissions = False
        return ops

    def _admit(self, ops: list[dict], budget: int) -> None:
        if not self.waiting:
            return  # spares _room's walk over every running block table on a decode step
        slots = self.max_num_seqs - len(self.running)
        room, admitted = self._room(), 0
        for req in self.waiting:
            n = min(len(req.tokens), budget)
            if slots <= 0 or n == 0 or (not self.chunked and n < len(req.tokens)):
                break
            room -= -(-(n + self._lookahead(n)) // self.block_size)
            if room < 0 and (self.running or admitted):
                break  # an idle pool still tries its head: the manager has the last word
            hashes = list(req.hasher.hashes) if self.caching else []
            ops.append({"op": "alloc", "req": req.rid, "hashes": hashes, "prompt_len": len(req.tokens),
                        "max_new": n, "lookahead": self._lookahead(n)})
            self._actions.append(("alloc", req, n))
            budget -= n
            slots -= 1
            admitted += 1
            if self._head_blocked:
                break  # the head was refused for space: no one overtakes it

    def _room(self) -> int:
        """Blocks an admission may take and still leave every running request one block to
        grow into: an estimate from the blocks our requests hold (cache hits not counted), so
        admissions stop before decodes start to preempt. The manager still decides. Statically
        preallocated requests hold their whole max_model_len already and never grow."""
        if self.num_blocks is None:
            return 1 << 62
        held = len({b for r in self.running for b in r.block_table})
        growth = 0 if self.static else len(self.running)
        return self.num_blocks - 1 - held - growth

    # -- applying the manager's answers ----------------------------------------------------

    def commit(self, results: list[dict]) -> StepPlan:
        if len(results) != len(self._actions):
            raise RuntimeError(f"manager answered {len(results)} results for {len(self._actions)} sub-ops")
        plan, failed = StepPlan(), []  # failed: (request, tokens) refused for space
        self._scheduled, self._victims = [], []
        self._head_blocked = False
        self.drain_refused = False
        for (kind, req, n), res in zip(self._actions, results):
            if kind == "free":
                if not res.get("ok") and res.get("code") != "unknown_request":
                    logger.warning("free refused: %s", res)
            elif kind == "fork":
                if res.get("ok"):
                    req.block_table = list(res["blocks"])
                else:
                    logger.warning("fork of %r refused (%s): recomputing it", req, res.get("msg"))
                    self._lose(req)
            elif kind == "extend":
                self._commit_extend(req, n, res, plan, failed)
            else:
                self._commit_alloc(req, n, res)
        self._actions = []
        if failed:
            self._choose_victims(failed)
        for req, n in self._scheduled:
            end = req.num_computed + n
            plan.seqs.append(SeqPlan(req.tokens[req.num_computed : end], req.num_computed,
                                     list(req.block_table), end == len(req.tokens)))
        self._track_usage()
        return plan

    def _commit_extend(self, req, n, res, plan: StepPlan, failed: list) -> None:
        if res.get("ok"):
            req.block_table.extend(res["blocks"])
            for index, src, dst in res["copies"]:
                req.block_table[index] = dst
                plan.copies.append((src, dst))
            req.num_hashes_sent += len(self._new_hashes(req, req.num_computed + n))
            self._scheduled.append((req, n))
        elif res.get("code") == "no_space":
            failed.append((req, n))
        else:
            logger.warning("extend of %r refused (%s): recomputing it", req, res.get("msg"))
            self._lose(req)

    def _commit_alloc(self, req, n, res) -> None:
        if res.get("ok"):
            cached = res["cached"]
            req.num_computed, req.block_table = cached, list(res["blocks"])
            req.num_hashes_sent = len(req.hasher.hashes) if self.caching else 0
            self.waiting.remove(req)
            self.running.append(req)
            self._scheduled.append((req, min(n, len(req.tokens) - cached)))
            self.stats.prompt_tokens += len(req.tokens)
            self.stats.cached_tokens += cached
        elif res.get("code") == "no_space":
            self._head_blocked = self._head_blocked or req is self.waiting[0]
        elif res.get("code") == "draining":
            self.drain_refused = True
        else:
            req.finish_reason = f"error: {res.get('msg', res.get('code'))}"
            self.waiting.remove(req)
            self.errored.append(req)

    def _blocks_short(self, req: Request, n: int) -> int:
        return max(0, -(-(req.num_computed + n) // self.block_size) - len(req.block_table))

    def _choose_victims(self, failed: list[tuple[Request, int]]) -> None:
        """Preempts newest-first until the blocks they hold cover what the refused requests
        lacked (an estimate: the manager stays the judge, a shortfall fails again next step)."""
        short = {req: self._blocks_short(req, n) for req, n in failed}
        need = sum(short.values())
        for victim in reversed(list(self.running)):
            if need <= 0:
                break
            self._victims.append(victim)
            need -= len(victim.block_table) + short.get(victim, 0)
            if victim in short:  # it did not run this step: preempt it now
                self._preempt(victim)
        self._hold_admissions = True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pending_frees.append(req.rid)
        req.reset_kv()
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)  # newest preempted first, so the oldest ends up in front
        logger.info("preempted %r", req)

    def _lose(self, req: Request) -> None:
        """The manager holds nothing for ``req``: recompute it from scratch, nothing to free."""
        if req not in self.running:
            return  # already lost (a refused fork, then its refused extend)
        self.running.remove(req)
        req.reset_kv()
        self.waiting.appendleft(req)

    def _track_usage(self) -> None:
        s = self.stats
        s.steps += 1
        s.peak_running = max(s.peak_running, len(self.running))
        blocks = {b for r in self.running for b in r.block_table}
        s.peak_blocks = max(s.peak_blocks, len(blocks))

    # -- after the forward pass ------------------------------------------------------------

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        return self._scheduled

    def advance(self) -> None:
        """Marks the scheduled tokens computed (the forward pass wrote their K/V)."""
        for req, n in self._scheduled:
            req.num_computed += n
            self.stats.computed_tokens += n

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.running.remove(req)
        self.pending_frees.append(req.rid)

    def drop(self, req: Request) -> None:
        """Aborts ``req`` wherever it is; its blocks go back at the next step."""
        if req in self.waiting:
            self.waiting.remove(req)  # a preempted one's free is already pending
            return
        if req not in self.running:
            return
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

    def end_step(self) -> None:
        """Preempts this step's victims that ran (their blocks go back at the next step)."""
        for req in self._victims:
            if req in self.running:
                self._preempt(req)
        self._victims = []

    def reset(self) -> list[Request]:
        """The manager lost every request: all recompute; returns them (running first)."""
        lost = list(self.running)
        for req in reversed(lost):
            self._lose(req)
        self.pending_frees, self.pending_forks, self._actions = [], [], []
        return lost
