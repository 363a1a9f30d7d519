"""The registry's mutations as typed records: what the journal stores and replays.

Every change of the registry's state goes through ``Registry.apply(record, now)``: the live
path (the handlers, through the registry's named methods) and the journal's replay
(manager/store/journal.py) alike, so a replay runs the very code that ran live. Each record
carries every nondeterministic value already resolved (a new session's sid, the limits a
registration was checked against).

On the wire (inside journal batches) a record is a msgpack list, its kind first::

    ["open", sid, identity, role, admin, version]           SessionOpened (hello)
    ["end", sid, cause]                                     SessionEnded ("deregister" or "expired";
                                                            absent in older journals: deregister)
    ["register", sid, pool, rank, count, incarnation, spec, available_kv_bytes, max_blocks, max_pools]
                                                            (+ serve, only when the worker announced one
                                                             or host_kv_bytes follows; + host_kv_bytes,
                                                             only when > 0 or a policy follows;
                                                             + host_kv_policy, only when not "demote")
                                                            (+ node_model, only when the worker offered one)
                                                            (+ node_tier, the node-tier settings it joined
                                                             under, only when the manager ran one)
    ["step", sid, msg_id, pool, ops]                        StepRan: run_step again, the same results
    ["node_done", sid, pool, batch, failed, late?]          NodeFinished: a node-tier batch ran
    ["pin", pool, hashes, ttl_s, now, share]   ["unpin", pin_id, expired]   retention pins (manager/state/pins.py)
    ["node_join", sid, spec, model, rank, world, node_tier]   NodeJoined: an engine joins a layout's node tier
                                                            (node_tier: the settings it joined under)
    ["node_load", sid, layout, batch, hashes, priority]     EngineLoaded: an engine's load batch
    ["node_save", sid, layout, batch, blocks, hashes, parents, priority]   EngineSaved: its save batch
    ["node_engine_done", sid, layout, batch, failed, late?] EngineFinished: an engine's batch ran
    ["reset", pool]   ["evict", pool, n]   ["drain", enable]   ["drop", pool] (PoolDropped)
    (reset and evict + tier "host" for the host tier)
    ["attach", {name, model, url, block_size, topic, events, replay}]   ExternalAttached (the attach op)
    ["detach", name]                                        ExternalDetached
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvpool.manager.state.attachment import Attachment
from kvpool.shared.protocol import KVSpec, ManagerError


@dataclass(frozen=True)
class SessionOpened:
    sid: str
    identity: str
    role: str
    admin: bool
    version: int


@dataclass(frozen=True)
class SessionEnded:
    sid: str
    cause: str = "deregister"  # or "expired": the shards it held keep its sid (their worker died)


@dataclass(frozen=True)
class ShardRegistered:
    """Journaled before anything can fail, with the limits in force: a replay fails or succeeds
    exactly as the live call did, whatever the restarted manager is configured with."""

    sid: str
    pool: str
    rank: int
    count: int
    incarnation: str
    spec: KVSpec  # on the wire: its map (shared/protocol.py)
    available_kv_bytes: int
    max_blocks: int
    max_pools: int
    serve: dict | None = None  # {endpoint, model, max_model_len}: where rank 0 takes generate requests
    host_kv_bytes: int = 0  # host memory offered for the pool's host tier (0: none)
    host_kv_policy: str = "demote"  # or "write_through"
    node_model: str | None = None  # the weights' identity: the pool may use its layout's node tier
    node_tier: list | None = None  # the node-tier settings it joins under (manager/node_tiers.py; None: none)


@dataclass(frozen=True)
class StepRan:
    sid: str
    msg_id: int
    pool: str
    ops: list  # as on the wire (shared/step_ops.py decodes them)
    decoded: list | None = field(default=None, compare=False, repr=False)  # not journaled: the live path's records


@dataclass(frozen=True)
class CacheReset:
    pool: str
    tier: str = "device"  # or "host" (the pool's host tier); on the wire only when "host"


@dataclass(frozen=True)
class BlocksEvicted:
    pool: str
    n: int
    tier: str = "device"


@dataclass(frozen=True)
class DrainingSet:
    enable: bool


@dataclass(frozen=True)
class PoolDropped:
    pool: str


@dataclass(frozen=True)
class NodeFinished:
    """A worker ran batch ``batch`` of its session's node-tier orders in ``pool``; ``failed``:
    the orders that did not land, ``late``: disk loads past the read deadline, as on the wire
    (shared/node_orders.py)."""

    sid: str
    pool: str
    batch: int
    failed: list
    late: list = field(default_factory=list)


@dataclass(frozen=True)
class PinAdded:
    """A retention pin of ``hashes`` in ``pool`` for ``ttl_s`` from wall-clock ``now``."""

    pool: str
    hashes: list
    ttl_s: float
    now: float
    share: float = 0.25  # the pinned share of the pool's device blocks in force (the node tier keeps its own)


@dataclass(frozen=True)
class PinRemoved:
    pin_id: int
    expired: bool = False  # its time ran out (else: unpinned)


@dataclass(frozen=True)
class NodeJoined:
    """An engine that owns its device blocks (vLLM's connector) joins the node tier of its layout
    (manager/core/engine_node.py); ``spec`` as on the wire (shared/protocol.py KVSpec)."""

    sid: str
    spec: dict
    model: str
    rank: int
    world: int
    node_tier: list | None = None  # the node-tier settings it joins under (None: the manager runs none)


@dataclass(frozen=True)
class EngineLoaded:
    """An engine's lookup held for its batch ``batch``: the run of ``hashes`` the tier brings up."""

    sid: str
    layout: str
    batch: int
    hashes: list
    priority: int


@dataclass(frozen=True)
class EngineSaved:
    """An engine's computed ``blocks`` (its own block ids), each holding the hash beside it."""

    sid: str
    layout: str
    batch: int
    blocks: list
    hashes: list
    parents: list
    priority: int


@dataclass(frozen=True)
class EngineFinished:
    """An engine ran its batch ``batch``; ``failed``: the orders that did not land, ``late``:
    disk loads past the read deadline (wire maps)."""

    sid: str
    layout: str
    batch: int
    failed: list
    late: list = field(default_factory=list)


@dataclass(frozen=True)
class ExternalAttached:
    """A vLLM server attached with the attach op (manager/external/): a restarted or failed-over
    manager attaches it again. (Those of the config are attached from it at each start.)"""

    spec: Attachment  # on the wire: its map


@dataclass(frozen=True)
class ExternalDetached:
    name: str


Mutation = (SessionOpened | SessionEnded | ShardRegistered | StepRan | CacheReset | BlocksEvicted | DrainingSet
            | PoolDropped | NodeFinished | PinAdded | PinRemoved | NodeJoined | EngineLoaded | EngineSaved
            | EngineFinished | ExternalAttached | ExternalDetached)

KINDS: dict[str, type] = {
    "open": SessionOpened,
    "end": SessionEnded,
    "register": ShardRegistered,
    "step": StepRan,
    "reset": CacheReset,
    "evict": BlocksEvicted,
    "drain": DrainingSet,
    "drop": PoolDropped,
    "node_done": NodeFinished,
    "pin": PinAdded,
    "unpin": PinRemoved,
    "node_join": NodeJoined,
    "node_load": EngineLoaded,
    "node_save": EngineSaved,
    "node_engine_done": EngineFinished,
    "attach": ExternalAttached,
    "detach": ExternalDetached,
}
_LAYOUT = {cls: (kind, tuple(f.name for f in fields(cls) if f.compare)) for kind, cls in KINDS.items()}


def to_wire(rec: Mutation) -> list:
    """The record as the journal's msgpack list (the layout in the module docstring)."""
    kind, names = _LAYOUT[type(rec)]
    wire = [kind, *(getattr(rec, name) for name in names)]
    if type(rec) in (NodeFinished, EngineFinished) and not rec.late:  # type: ignore[union-attr]
        wire.pop()  # the layout of journals from before deadline misses were reported apart
    if type(rec) in (CacheReset, BlocksEvicted) and rec.tier == "device":  # type: ignore[union-attr]
        wire.pop()  # the layout of journals from before the host tier
    if type(rec) is ExternalAttached:
        wire[1] = rec.spec.to_wire()
    if type(rec) is ShardRegistered:
        wire[6] = rec.spec.to_wire()
        if rec.node_tier is None:  # the manager ran no node tier
            wire.pop()
        if rec.node_model is None and rec.node_tier is None:  # the layout of journals from before the node tier
            wire.pop()
            if rec.host_kv_policy == "demote":  # the layout of journals from before the choice
                wire.pop()
                if not rec.host_kv_bytes:  # no host tier: the layout of journals from before it
                    wire.pop()
                    if rec.serve is None:
                        wire.pop()  # records without serve keep their original layout
    return wire


def from_wire(raw: object) -> Mutation:
    """A journal list back into its record; ValueError or TypeError when it is not one."""
    if type(raw) is not list or not raw:
        raise TypeError(f"a journal record is a non-empty list, got {type(raw).__name__}")
    cls = KINDS.get(raw[0]) if type(raw[0]) is str else None
    if cls is None:
        raise ValueError(f"journal record of unknown kind {raw[0]!r:.40}")
    if cls is ShardRegistered and len(raw) > 6:
        try:
            raw = [*raw[:6], KVSpec.from_wire(raw[6]), *raw[7:]]
        except ManagerError as e:
            raise ValueError(f"register record: {e}") from None
    if cls is ExternalAttached and len(raw) == 2:
        try:
            return ExternalAttached(Attachment.from_wire(raw[1]))
        except ManagerError as e:
            raise ValueError(f"attach record: {e}") from None
    return cls(*raw[1:])
