"""``KvpoolConnector``: the ``KVConnectorBase_V1`` vLLM loads (kvpool.integrations.vllm's
docstring shows how), one object per role: the scheduler half (scheduler.py) in vLLM's engine
core, the worker half (worker.py) in each worker. Written against the connector API of vLLM
0.32.0 and 0.33.0 (``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` of each; 0.33.0
adds the sleep-mode hooks, answered here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpool.integrations.vllm.kv_layout import block_view
from kvpool.integrations.vllm.link import ManagerLink
from kvpool.integrations.vllm.records import ConnectorSettings, NodeStepPlan, NodeStepReport
from kvpool.integrations.vllm.scheduler import KvpoolScheduler
from kvpool.integrations.vllm.worker import KvpoolWorker
from kvpool.shared.protocol import KVSpec
from kvpool.worker.node_store import StoreLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class KvpoolMetadata(KVConnectorMetadata):
    plan: NodeStepPlan = field(default_factory=NodeStepPlan)


@dataclass
class KvpoolWorkerMetadata(KVConnectorWorkerMetadata):
    report: NodeStepReport = field(default_factory=NodeStepReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvpoolWorkerMetadata):
            return self
        return KvpoolWorkerMetadata(self.report.merge(other.report))


def kv_spec(vllm_config: VllmConfig, kv_cache_config: Any) -> tuple[KVSpec, list[str]]:
    """The node-tier spec of vLLM's one KV cache group, and its layer names in order; a clear
    refusal of what the connector does not move (several groups, MLA, tensor parallelism)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvpool's connector moves one KV cache group; this model has {len(groups)}")
    if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("kvpool's connector runs with tensor and pipeline parallel size 1")
    spec = groups[0].kv_cache_spec
    if getattr(vllm_config.model_config, "use_mla", False) or spec.dtype not in _DTYPES:
        raise ValueError(f"kvpool's connector moves plain attention K/V of float16/bfloat16/float32, not "
                         f"{type(spec).__name__} {spec.dtype}")
    return KVSpec(spec.block_size, len(groups[0].layer_names), spec.num_kv_heads, spec.head_size,
                  _DTYPES[spec.dtype]), list(groups[0].layer_names)


class KvpoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        settings = ConnectorSettings.from_extra(dict(cfg.kv_connector_extra_config or {}))
        if getattr(cfg, "kv_load_failure_policy", "recompute") != "recompute":
            raise ValueError('kvpool\'s connector reports a block that did not verify as a load error, which vLLM '
                             'must recompute: add "kv_load_failure_policy": "recompute" to --kv-transfer-config')
        spec, self.layer_names = kv_spec(vllm_config, kv_cache_config)
        mc = vllm_config.model_config
        model = settings.node_model or f"vllm:{mc.model}@{mc.revision or ''}"
        self.block_size = spec.block_size
        self.scheduler: KvpoolScheduler | None = None
        self.worker: KvpoolWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            link = ManagerLink(settings.manager, spec.to_wire(), model, timeout_s=settings.timeout_s,
                               retry_s=settings.retry_s)
            self.scheduler = KvpoolScheduler(link, spec.block_size)
        else:
            self.worker = KvpoolWorker(StoreLayout(spec, model), settings.read_timeout_s)
            from vllm.platforms import current_platform

            self.kind = "cpu" if current_platform.is_cpu() else "split"
        logger.info("kvpool connector (%s): manager %s, layout %s", role.name, settings.manager,
                    StoreLayout(spec, model).name)

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.worker.layout.spec  # type: ignore[union-attr]
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layers {missing[:4]}")
        self.worker.register([block_view(kv_caches[n], self.kind, s.block_size, s.num_kv_heads, s.head_size)  # type: ignore[union-attr]
                              for n in self.layer_names])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvpoolMetadata):
            self.worker.load(meta.plan)  # type: ignore[union-attr]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load ran in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved in wait_for_save, every layer at once

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvpoolMetadata):
            self.worker.save(meta.plan)  # type: ignore[union-attr]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.take_report() if self.worker is not None else None
        return KvpoolWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.link.close()

    # -- scheduler side ----------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens), False  # type: ignore[union-attr]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            self.scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)  # type: ignore[union-attr]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvpoolMetadata(self.scheduler.plan(scheduler_output))  # type: ignore[union-attr]

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvpoolWorkerMetadata):
            self.scheduler.reported(meta.report)  # type: ignore[union-attr]

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.finished(request)  # type: ignore[union-attr]
        return False, None

    # -- vLLM 0.33.0's sleep mode: the views into vLLM's cache would dangle after a remap ------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False
