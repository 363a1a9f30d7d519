"""The connector's scheduler half: which tokens beyond vLLM's own cache the node tier holds, the
loads vLLM accepted, the saves of what each step computes, the workers' reports to the manager.

It reads vLLM's objects (``Request``, ``SchedulerOutput``) by the attributes 0.32.0 and 0.33.0
both give them, and imports nothing of vLLM. The hashes are kvpool's own chain (shared/hashing.py)
of the request's token ids, with vLLM's ``cache_salt`` on the first block and the LoRA name on
every block, as the manager's mirror of vLLM's KV events keys them; a request with multimodal
inputs or prompt embeddings is left to vLLM (their keys are not token ids).

The order of one request's life, in vLLM's calls:
  * ``lookup`` (``get_num_new_matched_tokens``): the run of the prompt's full blocks after vLLM's
    own hits that the tier can bring up now, never the block of the prompt's last token (its
    logits must be computed). No side effect: vLLM may ask again.
  * ``allocated`` (``update_state_after_alloc``): vLLM took blocks for the load: ``node_load``
    holds the run for a batch; positions the tier no longer holds become load errors at once.
  * ``plan`` (``build_connector_meta``): every scheduled request's blocks that are full once the
    step ran are saved (``node_save``; the tier skips hashes it holds), loads go out with it.
  * ``reported`` (``update_connector_output``): the workers' reports go to the manager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvpool.integrations.vllm.link import ManagerLink
from kvpool.integrations.vllm.records import LoadJob, NodeStepPlan, NodeStepReport, SaveJob
from kvpool.shared.hashing import SEED, hash_blocks
from kvpool.shared.protocol import ManagerError

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    request: Any  # vLLM's Request: read, never written
    hashes: list[bytes] = field(default_factory=list)  # kvpool's chain of its full blocks so far
    block_ids: list[int] = field(default_factory=list)  # vLLM's block table (the one KV group)
    local: int = 0  # blocks vLLM had cached itself at admission
    promised: int = 0  # blocks the lookup said the tier brings up
    saved: int = 0  # leading blocks handed to node_save (or loaded)


@dataclass
class ConnectorSchedulerStats:
    lookups: int = 0
    hit_blocks: int = 0  # blocks vLLM accepted to load
    held_blocks: int = 0  # of those, held by node_load
    save_blocks: int = 0  # blocks asked to save
    save_orders: int = 0


class KvpoolScheduler:
    def __init__(self, link: ManagerLink, block_size: int) -> None:
        self.link, self.block_size = link, block_size
        self.reqs: dict[str, _Req] = {}
        self.loads: list[LoadJob] = []
        self._pending: list[tuple[str, _Req, int, int]] = []  # (req_id, state, first, end) to save
        self.stats = ConnectorSchedulerStats()
        self._batch = 0

    def _next_batch(self) -> int:
        self._batch += 1
        return self._batch

    def _chain(self, st: _Req, blocks: int) -> list[bytes]:
        """The request's hashes of its first ``blocks`` full blocks (extended as tokens come)."""
        have = len(st.hashes)
        if blocks > have:
            r, bs = st.request, self.block_size
            tokens = list(r.all_token_ids[have * bs : blocks * bs])
            lora = r.lora_request.lora_name if getattr(r, "lora_request", None) is not None else None
            st.hashes += hash_blocks(tokens, bs, parent=st.hashes[-1] if have else SEED, first_block=have,
                                     cache_salt=r.cache_salt, lora=lora)
        return st.hashes[:blocks]

    # -- vLLM's scheduler calls ------------------------------------------------------------

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own, block-aligned) the tier brings up."""
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            self.reqs.pop(request.request_id, None)  # neither loaded nor saved: its keys are not its token ids
            return 0
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self.reqs[request.request_id] = _Req(request)
        st.local, st.promised = num_computed_tokens // self.block_size, 0
        limit = (request.num_tokens - 1) // self.block_size  # the last token's block is computed
        if limit <= st.local or not self.link.usable():
            return 0
        self.stats.lookups += 1
        try:
            st.promised = self.link.lookup(self._chain(st, limit)[st.local:])
        except ManagerError:
            return 0
        return st.promised * self.block_size

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's whole table) and will load
        ``num_external_tokens`` after its own hits: hold them now."""
        st = self.reqs.get(request.request_id)
        n = num_external_tokens // self.block_size
        if st is None or n == 0:
            return
        st.block_ids = list(block_ids)
        target = st.block_ids[st.local : st.local + n]
        hashes = self._chain(st, st.local + n)[st.local:]
        self.stats.hit_blocks += n
        batch, got, orders = None, 0, []
        if self.link.usable():
            try:
                batch = self._next_batch()
                got, orders = self.link.load(batch, hashes, getattr(request, "priority", 0) or 0, [])
            except ManagerError:
                batch, got, orders = None, 0, []
        self.stats.held_blocks += got
        st.saved = st.local + n  # loaded blocks are the tier's already; a failed one is saved once recomputed
        self.loads.append(LoadJob(request.request_id, batch, orders, target, target[got:], st.local))

    def plan(self, out: Any) -> NodeStepPlan:
        """The step's plan: the loads accepted since the last one, and the saves of every block
        full once this step ran."""
        plan = NodeStepPlan(self.link.info.to_wire() if self.link.info is not None else None, self.loads)
        self.loads = []
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._to_save(st, new.req_id, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids += new_ids[0]
            self._to_save(st, req_id, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0),
                          computed=cached.num_computed_tokens[i])
        plan.save = self._save_job()
        return plan

    def _to_save(self, st: _Req, req_id: str, tokens_after: int, computed: int | None = None) -> None:
        if computed is not None:  # vLLM went back (a failed load recomputed, a preemption): save again
            st.saved = min(st.saved, computed // self.block_size)
        full = min(tokens_after // self.block_size, len(st.block_ids), len(st.request.all_token_ids) // self.block_size)
        if full > st.saved:
            self._pending.append((req_id, st, st.saved, full))
            st.saved = full

    def _save_job(self) -> SaveJob | None:
        pending, self._pending = self._pending, []
        if not pending or not self.link.usable():
            return None
        blocks, hashes, parents, owners, priority = [], [], [], {}, None
        for req_id, st, start, end in pending:
            chain = self._chain(st, end)
            for i in range(start, end):
                blocks.append(st.block_ids[i])
                hashes.append(chain[i])
                parents.append(chain[i - 1] if i else None)
                owners[chain[i]] = (req_id, i)
            p = getattr(st.request, "priority", 0) or 0
            priority = p if priority is None else min(priority, p)
        self.stats.save_blocks += len(blocks)
        batch = self._next_batch()
        try:
            orders = self.link.save(batch, blocks, hashes, parents, priority or 0, [])
        except ManagerError:
            return None
        self.stats.save_orders += len(orders)
        return SaveJob(batch, orders, owners)

    def finished(self, request: Any) -> None:
        self.reqs.pop(request.request_id, None)

    def reported(self, report: NodeStepReport | None) -> None:
        if report is None or not report.reports or not self.link.usable():
            return
        try:
            self.link.done(report.reports)
        except ManagerError:
            pass  # that manager's batches are gone with it
