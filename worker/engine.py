"""The generate API: add requests, step, stream tokens. One scheduler step = one manager message.

    engine = build_engine(WorkerConfig(model="tiny"), LocalBlockManager())   # worker/startup.py
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    while engine.has_work():
        for ev in engine.step(): ...                                          # TokenEvent

How a step runs against the manager (plain, or overlapped with the next step's round trip: the
default) is worker/step_loop.py's, which this class extends; the requests' ids and the events a
step gives out are worker/live_requests.py's.

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

from kvpool.shared.node_tier import READ_TIMEOUT_S, NodeTierInfo
from kvpool.shared.step_ops import Free
from kvpool.worker.block_manager import BlockManager, ManagerReset
from kvpool.worker.draw import draw_tokens
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.live_requests import LiveRequests, TokenEvent, end_events
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.node_agreement import NodeAgreement
from kvpool.worker.node_copier import map_stores
from kvpool.worker.profiler import check_fits
from kvpool.worker.request import Request
from kvpool.worker.runner import ModelRunner, allocate_runner
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Batch, Output, Scheduler, Updated
from kvpool.worker.step_loop import StepLoop
from kvpool.worker.tp import TPLeader

__all__ = ["Engine", "TokenEvent"]

logger = logging.getLogger(__name__)


class Engine(StepLoop):
    def __init__(self, model: LlamaForCausalLM, block_manager: BlockManager, scheduler: Scheduler,
                 available_kv_bytes: int, *, seed: int = 0, tp: TPLeader | None = None,
                 overlap: bool = True, host_kv_bytes: int = 0, host_kv_policy: str = "demote",
                 node_model: str | None = None, node_read_timeout_s: float = READ_TIMEOUT_S) -> None:
        super().__init__(block_manager, scheduler, overlap)
        self.model = model
        self.available_kv_bytes = available_kv_bytes
        self.host_kv_bytes = host_kv_bytes  # host memory offered for the pool's host tier
        self.host_kv_policy = host_kv_policy  # "demote" or "write_through" (manager/core/host_tier.py)
        self.host_num_blocks = 0  # what the manager made of it
        # the weights' identity, offered at registration: the manager then puts the node tier of
        # this layout behind the pool (worker/node_copier.py); None: no node tier
        self.node_model = node_model
        self.node_read_timeout_s = node_read_timeout_s  # a step's wait for its disk reads (worker/node_disk_io.py)
        self.node_tier: NodeTierInfo | None = None
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
        self._rng = random.Random(seed)
        self._request_ids = itertools.count()  # req-0, req-1, ... for add_request without an id
        self._requests = LiveRequests()  # request id -> its live samples
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
        # with tensor parallelism the other ranks run the same orders on their stores: one outcome
        agree = NodeAgreement(self.model.reduce, self.tp.channel, True, self.device) if self.tp is not None else None
        self.runner.attach_node(map_stores(self.runner.kv_caches, info, self.spec, self.node_model or "", 0,  # type: ignore[union-attr]
                                           self.model.tp_size, self.node_read_timeout_s), agree)
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
        return [ev for r in reqs for ev in end_events(r, "abort")]

    # -- what a step runs (worker/step_loop.py runs the step), the session kept alive ---------

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

    def _events(self, outputs: list[Output], done: Updated) -> list[TokenEvent]:
        return self._requests.end_with_error(done.errored) + self._requests.token_events(outputs, done)

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
            "generated_tokens": self.generated_tokens, "peak_blocks": s.peak_blocks, "peak_running": s.peak_running,
            "registrations": self.registrations, "resets": self.resets, "overlap": self.overlap,
            "manager_wait_s": self.manager_wait_s, "arrival_waits": self.arrival_waits,
            "late_admissions": self.late_admissions,
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
