"""What the connector's two halves hand each other through vLLM, and its settings.

vLLM runs the scheduler half in its engine-core process and the worker half in each worker
process; it carries ``NodeStepPlan`` from the first to the second with every scheduler step (inside
the connector's ``KVConnectorMetadata``) and ``NodeStepReport`` back (inside its
``KVConnectorWorkerMetadata``). Both are plain picklable records (vLLM pickles them between its
processes); neither imports vLLM, so they test without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.shared.node_orders import Order
from kvpool.shared.node_tier import READ_TIMEOUT_S


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of ``--kv-transfer-config``: ``manager`` (the manager's
    endpoint, required), ``timeout_s`` (one call's limit, default 2), ``retry_s`` (how long the
    connector leaves a manager that failed alone, default 5), ``node_model`` (the weights'
    identity in the layout id; default ``vllm:`` + the served model's path and revision),
    ``read_timeout_s`` (how long a step waits for its node-tier disk reads before vLLM
    recomputes those blocks, and then for its write-downs, default 5: worker/node_disk_io.py)."""

    manager: str
    timeout_s: float = 2.0
    retry_s: float = 5.0
    node_model: str | None = None
    read_timeout_s: float = READ_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.manager, str) or not self.manager.startswith(("ipc://", "tcp://")):
            raise ValueError(f'kv_connector_extra_config needs "manager": "ipc://PATH" or "tcp://HOST:PORT" '
                             f"(the kvpool manager's endpoint), got {self.manager!r}")
        for name in ("timeout_s", "retry_s", "read_timeout_s"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not 0 < v <= 3600:
                raise ValueError(f"kv_connector_extra_config {name!r} must be seconds in (0, 3600], got {v!r}")
        if self.node_model is not None and (not isinstance(self.node_model, str) or not 0 < len(self.node_model) <= 512):
            raise ValueError(f"kv_connector_extra_config 'node_model' must be 1-512 characters, got {self.node_model!r}")

    @classmethod
    def from_extra(cls, extra: dict) -> ConnectorSettings:
        known = {"manager", "timeout_s", "retry_s", "node_model", "read_timeout_s"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; kvpool's connector takes {sorted(known)}")
        if "manager" not in extra:
            raise ValueError('kv_connector_extra_config needs "manager": the kvpool manager\'s endpoint '
                             "(kvpool manager --node-tier-memory SIZE listens on ipc://$XDG_RUNTIME_DIR/kvpool/manager.sock)")
        return cls(**extra)


@dataclass(frozen=True)
class LoadJob:
    """One request's load: ``orders`` of node-tier batch ``batch`` (None: the manager gave none)
    into vLLM ``blocks`` (a host load's ``dst`` is a 1-based position in it); ``missing``: blocks
    vLLM was promised that the tier no longer held (load errors: vLLM recomputes them).
    ``first_index``: the request's block index of ``blocks[0]``."""

    req_id: str
    batch: int | None
    orders: list[Order]
    blocks: list[int]
    missing: list[int]
    first_index: int


@dataclass(frozen=True)
class SaveJob:
    """The step's saves: ``orders`` of batch ``batch``, run after the forward pass; ``owners``:
    each saved hash's request and block index (a block at or after a failed load of its request
    in this step is not saved: its K/V were computed over bytes that are not there)."""

    batch: int
    orders: list[Order]
    owners: dict[bytes, tuple[str, int]]


@dataclass
class NodeStepPlan:
    """One scheduler step's node-tier work: where the tier lives (``tier``: ``node_tier`` as
    ``node_join`` answered it; None: no tier now), the loads to run before the forward pass and
    the saves after it."""

    tier: dict | None = None
    loads: list[LoadJob] = field(default_factory=list)
    save: SaveJob | None = None


@dataclass
class NodeStepReport:
    """What the workers ran: node-tier reports (``{batch, failed?, late?}`` as PROTOCOL.md's
    ``node_done`` takes them) and copy counts, summed over the workers."""

    reports: list[dict] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def merge(self, other: NodeStepReport) -> NodeStepReport:
        counts = dict(self.counts)
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0) + v
        return NodeStepReport(self.reports + other.reports, counts)
