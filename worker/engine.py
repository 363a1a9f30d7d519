"""The generate API: add requests, step, stream tokens. One scheduler step = one manager message.

    engine = build_engine(WorkerConfig(model="tiny"), LocalBlockManager())   # worker/startup.py
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    while engine.has_work():
        for ev in engine.step(): ...                                          # TokenEvent

With ``overlap`` (the default) step N+1's message goes to the manager before step N's forward
pass and is collected after it, so the round trip hides behind the compute (``manager_wait_s``
counts the time a step still waited).

The engine owns the KV tensors (allocated once from the num_blocks the manager returned at
registration) and re-registers when the manager forgot its requests (``ManagerReset``): every
request is then recomputed from its tokens, the sampled ones included.

With tensor parallelism this is rank 0's engine: ``tp`` (worker/tp.py) tells the other ranks to
register, run each step's plan and stay alive; they hold the other slices of the KV heads.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from dataclasses import dataclass

from kvpool.shared.node_orders import NodeReport
from kvpool.shared.node_tier import NodeTierInfo
from kvpool.shared.protocol import ManagerError
from kvpool.shared.step_ops import Free
from kvpool.worker.block_manager import BlockManager, ManagerReset
from kvpool.worker.config import READ_TIMEOUT_S
from kvpool.worker.draw import draw_tokens
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.node_copier import NodeCopier
from kvpool.worker.node_store import StoreLayout
from kvpool.worker.profiler import check_fits
from kvpool.worker.request import Request
from kvpool.worker.runner import ModelRunner, allocate_runner
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Batch, Output, Scheduler, StepPlan, Updated
from kvpool.worker.tp import TPLeader

logger = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    request_id: str
    index: int  # which of the request's n samples
    token: int | None  # None: the request ended without a token (error, abort)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, a stop id), "length", "abort", "error: ..."
    logprob: float | None = None  # of the token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None


class Engine:
    def __init__(self, model: LlamaForCausalLM, block_manager: BlockManager, scheduler: Scheduler,
                 available_kv_bytes: int, *, seed: int = 0, tp: TPLeader | None = None,
                 overlap: bool = True, host_kv_bytes: int = 0, host_kv_policy: str = "demote",
                 node_model: str | None = None, node_read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.model = model
        self.bm = block_manager
        self.scheduler = scheduler
        self.available_kv_bytes = available_kv_bytes
        self.host_kv_bytes = host_kv_bytes  # host memory offered for the pool's host tier
        self.host_kv_policy = host_kv_policy  # "demote" or "write_through" (manager/core/host_tier.py)
        self.host_num_blocks = 0  # what the manager made of it
        # the weights' identity, offered at registration: the manager then puts the node tier of
        # this layout behind the pool (worker/node_copier.py); None: no node tier
        self.node_model = node_model
        self.node_read_timeout_s = node_read_timeout_s  # a step's wait for its disk reads (worker/node_reads.py)
        self.node_tier: NodeTierInfo | None = None
        self._node_reports: list[NodeReport] = []  # node-tier batches run, not yet told to the manager
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.block_size = scheduler.block_size
        if scheduler.eos_token_ids != frozenset(model.config.eos_token_ids):
            raise ValueError(f"the scheduler stops at EOS ids {sorted(scheduler.eos_token_ids)}, the model's are "
                             f"{list(model.config.eos_token_ids)}: build it with eos_token_ids=model.config.eos_token_ids")
        self.tp = tp
        # max_model_len: the manager bounds the tokens of one sub-op by it (manager/guards.py)
        self.spec = dataclasses.replace(kv_spec(model.config, self.block_size, self.dtype, model.tp_size),
                                        max_model_len=scheduler.max_model_len)
        self.num_blocks = 0
        self.runner: ModelRunner | None = None
        self.registrations = 0
        self.resets = 0
        self._lost = False
        self.overlap = overlap
        self.manager_wait_s = 0.0  # time a step spent blocked on the manager's answer
        self._ready: tuple[StepPlan, list[dict], Batch] | None = None  # overlap: answered, not run
        self._rng = random.Random(seed)
        self._request_ids = itertools.count()  # req-0, req-1, ... for add_request without an id
        # Why the last step made no progress ("draining": the manager refuses admissions), or None.
        # The serving loop backs off while it is set instead of resending the step at once.
        self.stalled: str | None = None
        self._ran = False  # the last step ran a batch
        self._requests: dict[str, list[Request]] = {}  # request id -> its live samples
        self.register()

    # -- registration ----------------------------------------------------------------------

    def register(self) -> None:
        """(Re-)registers with the manager; allocates the KV tensors when their size changes."""
        if self.tp is not None:
            self.tp.register()  # the other shards register alongside: the pool needs them all
        if self.node_model is not None and getattr(self.bm, "node_tier_capable", False):
            info = self.bm.register(self.spec, self.available_kv_bytes, self.host_kv_bytes, self.host_kv_policy,
                                    node_model=self.node_model)
        else:  # the call as before the node tier
            info = self.bm.register(self.spec, self.available_kv_bytes, self.host_kv_bytes, self.host_kv_policy)
        num_blocks = int(info["num_blocks"])
        self.host_num_blocks = int(info.get("host_num_blocks", 0))
        check_fits(num_blocks, self.block_size, self.scheduler.max_model_len)
        if num_blocks != self.num_blocks:
            if self.runner is not None:
                self.runner.attach_host(0)  # its host copies finish before its tensors go
            self.runner = None  # drop the old tensors before allocating new ones
            self.runner = allocate_runner(self.model, num_blocks, self.block_size)
            self.num_blocks = num_blocks
        self.runner.attach_host(self.host_num_blocks)  # same size: the tensors and their blocks stay
        self._attach_node(info.get("node_tier"))
        self.scheduler.set_pool_size(num_blocks)
        self.registrations += 1
        logger.info("registered pool %s: %d blocks of %d tokens, %d KV bytes on tensor-parallel rank 0 of %d",
                    self.bm.pool, num_blocks, self.block_size, self.runner.kv_bytes, self.model.tp_size)

    def _attach_node(self, wire: object) -> None:
        """Maps the node tier's stores the manager named (a NodeStoreError says what is wrong)."""
        self._node_reports = []
        if wire is None:
            self.node_tier = None
            self.runner.attach_node(None)  # type: ignore[union-attr]
            return
        info = NodeTierInfo.from_wire(wire)
        if info == self.node_tier and self.runner.node is not None:  # type: ignore[union-attr]
            self.runner.take_node_reports()  # type: ignore[union-attr]  # an earlier registration's: meaningless now
            return
        layout = StoreLayout(self.spec, self.node_model or "", 0, 1)
        self.runner.attach_node(NodeCopier(self.runner.kv_caches, info, layout, self.node_read_timeout_s))  # type: ignore[union-attr]
        self.node_tier = info
        logger.info("node tier of layout %s: %d host slots in %s, disk %s", info.layout, info.host_slots - 1,
                    info.host_dir, f"{info.disk_slots - 1} slots in {info.disk_dir}" if info.disk_dir else "none")

    # -- requests --------------------------------------------------------------------------

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        vocab = self.model.config.vocab_size
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not 0 < len(prompt) < self.scheduler.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; it needs 1 to "
                             f"{self.scheduler.max_model_len - 1} (max_model_len - 1)")
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        seed = params.seed if params.seed is not None else self._rng.randrange(1 << 31)
        if cache_salt is not None and (type(cache_salt) is not str or not 0 < len(cache_salt) <= 256):
            raise ValueError("cache_salt must be a string of 1-256 characters")
        req = Request(self.scheduler.new_rid(), request_id, 0, list(prompt), len(prompt), params, seed,
                      self.block_size, cache_salt)
        self._requests[request_id] = [req]
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> list[TokenEvent]:
        reqs = self._requests.pop(request_id, [])
        for req in reqs:
            self.scheduler.drop(req)
        return [ev for r in reqs for ev in self._end_events(r, "abort")]

    @staticmethod
    def _end_events(req: Request, reason: str) -> list[TokenEvent]:
        """Final events of a request ended without a token (its unspawned samples included)."""
        indices = range(req.params.n) if req.holds_all_samples else [req.index]
        return [TokenEvent(req.request_id, i, None, True, reason) for i in indices]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._lost or self._ready is not None or bool(self._node_reports)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One scheduler step. Raises ManagerUnavailable while the manager cannot be reached to
        re-register (the caller retries later; requests wait, nothing is lost)."""
        if self._lost:
            self.register()
            self._lost = False
        self.stalled, self._ran = None, False
        events = self._step_overlapped() if self.overlap else self._step_plain()
        if self.scheduler.drain_refused and not events and not self._ran:
            self.stalled = "draining"
        return events

    def _schedule_and_wait(self) -> tuple[StepPlan, list[dict]] | None:
        """Schedules a step and waits for the manager's answer to its ops: (plan, results), or
        None when there is nothing to do or the manager reset (the step is dropped)."""
        plan = self.scheduler.schedule()
        try:
            ticket = self._send(plan.ops)
            if not plan.ops and not plan.seqs:
                return None
            results = self._wait(ticket) if ticket is not None else []
        except ManagerReset as e:
            self._reset(e)
            return None
        except ManagerError:
            self.scheduler.abandon(plan)
            raise
        return plan, results

    def _step_plain(self) -> list[TokenEvent]:
        asked = self._schedule_and_wait()
        if asked is None:
            return []
        plan, results = asked
        outputs = self._run(plan.batch(results))
        done = self.scheduler.update(plan, results, outputs)
        return self._end_with_error(done.errored) + self._token_events(outputs, done)

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
        plan, results, batch = ready
        following = sched.schedule()  # step N+1
        try:
            ticket = self._send(following.ops)
        except ManagerReset as e:
            self._reset(e)
            return []
        except ManagerError:
            sched.abandon(following)  # step N's batch was made on it too: it starts over as well
            raise
        outputs = self._run(batch)
        done = sched.update(plan, results, outputs)
        events = self._end_with_error(done.errored) + self._token_events(outputs, done)
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

    def heartbeat(self) -> bool:
        """Keeps the manager session (and the other tensor-parallel ranks) alive while idle;
        notices a restarted manager. Raises TPPeerLost when another rank is gone. True when the
        manager answered a heartbeat just now."""
        if self.tp is not None:
            self.tp.tick()
        if self._lost:
            return False  # the session is already given up: re-registering opens a new one (no second reset)
        try:
            return self.bm.heartbeat()
        except ManagerReset as e:
            self._reset(e)
            return False

    def _reset(self, err: Exception) -> None:
        logger.warning("manager lost our requests (%s): re-registering, recomputing", err)
        self._ready = None
        self._node_reports = []  # the manager abandons the batches of a session it lost
        self.scheduler.reset()
        self.resets += 1
        self._lost = True

    def _end_with_error(self, errored: list[Request]) -> list[TokenEvent]:
        for req in errored:
            self._forget(req)
        return [ev for r in errored for ev in self._end_events(r, r.finish_reason or "error")]

    def _run(self, batch: Batch) -> list[Output]:
        """The forward pass over ``batch`` and its sampled tokens (an n > 1 request's first
        step draws all n: ``Output.sample`` says which; the scheduler spawns the others)."""
        if not batch.seqs and not batch.saves and not batch.loads and not batch.writes and batch.node_batch is None:
            return []
        self._ran = True
        if self.tp is not None:
            self.tp.run(batch)
        logits = self.runner.execute(batch)
        if self.runner.node_reports:
            self._node_reports += self.runner.take_node_reports()
        if not batch.seqs:  # only the tiers' copies ran
            return []
        return draw_tokens(batch, logits, self.model.config.eos_token_ids)

    def _token_events(self, outputs: list[Output], done: Updated) -> list[TokenEvent]:
        """Events of the tokens ``outputs`` drew, as the scheduler's update gave them out."""
        events = []
        for out, req in zip(outputs, done.receivers(outputs)):
            if out.sample:  # a parallel sample the scheduler spawned (the parent may have ended)
                self._requests.setdefault(req.request_id, []).append(req)
            if req.finish_reason == "abort":
                continue  # aborted while its step ran: its final event was sent by abort
            if req.finish_reason is not None:
                self._forget(req)
            events.append(TokenEvent(req.request_id, req.index, out.token, req.finish_reason is not None,
                                     req.finish_reason, out.logprob, out.top_logprobs))
        return events

    def _forget(self, req: Request) -> None:
        reqs = self._requests.get(req.request_id, [])
        if req in reqs:
            reqs.remove(req)
        if not reqs:
            self._requests.pop(req.request_id, None)

    # -- running to completion, shutting down ----------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[list[int]]]:
        """Runs ``prompts`` to completion; per prompt, the output tokens of each of its n samples."""
        ids = [self.add_request(p, params) for p in prompts]
        n = (params or SamplingParams()).n
        out: dict[str, list[list[int]]] = {rid: [[] for _ in range(n)] for rid in ids}
        while self.has_work():
            for ev in self.step():
                if ev.token is not None:
                    out[ev.request_id][ev.index].append(ev.token)
        return [out[rid] for rid in ids]

    def shutdown(self, reach_manager: bool = True) -> None:
        """Frees every request's blocks, deregisters and stops the other ranks (SIGTERM path).
        ``reach_manager`` False (it is known unreachable): only the ranks are stopped."""
        rids = self.scheduler.release_all()
        try:
            if not reach_manager:
                raise ManagerReset("the manager is unreachable")
            if rids and not self._lost:
                self.bm.step([Free(rid) for rid in rids])
            self.bm.deregister()
        except ManagerReset as e:  # forgotten by the manager, or it did not answer: gave up
            logger.warning("shutdown: %d requests not freed and the session not ended at the manager (%s); "
                           "it frees them when the session times out", len(rids), e)
        finally:
            if self.tp is not None:
                self.tp.stop()

    def stats(self) -> dict:
        s = self.scheduler.stats
        return {
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "steps": s.steps, "preemptions": s.preemptions, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens, "computed_tokens": s.computed_tokens,
            "peak_blocks": s.peak_blocks, "peak_running": s.peak_running,
            "registrations": self.registrations, "resets": self.resets, "overlap": self.overlap,
            "manager_wait_s": self.manager_wait_s,
            "tp_size": self.model.tp_size, "kv_cache_bytes": self.runner.kv_bytes if self.runner else 0,
            **self._node_stats(),
        }

    def _node_stats(self) -> dict:
        node = self.runner.node if self.runner is not None else None
        if node is None:
            return {}
        s = node.stats
        return {"node_layout": node.info.layout, "node_saves": dict(s.saves), "node_loads": dict(s.loads),
                "node_failures": dict(s.failures), "node_recomputed_tokens": s.recomputed_tokens,
                "node_copy_s": s.wall_s}
