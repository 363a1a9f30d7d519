"""Factories for node-tier tests: in-process pools of the `tiny` preset sharing one node tier,
its stores in a test's directory (the manager's bookkeeping, manager/core/node_tier.py, in the
test process; the bytes in real files, as a daemon's workers map them)."""

from __future__ import annotations

from pathlib import Path

from helpers.worker import BLOCK_BYTES, TINY
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.node_tiers import NodeTiers, NodeTierSettings
from kvpool.shared.node_tier import (
    NodeTierInfo,
    disk_slots,
    host_file,
    host_slots,
    host_stride,
    layout_id,
    shard_stores,
)
from kvpool.shared.protocol import KVSpec
from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import WorkerConfig, model_identity
from kvpool.worker.engine import Engine
from kvpool.worker.startup import build_engine

SPEC = KVSpec(16, TINY.num_layers, TINY.num_kv_heads, TINY.head_size, "float32")
MODEL = model_identity("tiny", 0)


def node_tier(tmp: Path, host_blocks: int, disk_blocks: int = 0, policy: str = "demote",
              **kw: object) -> tuple[NodeTier, NodeTierInfo]:
    """A node tier of ``host_blocks`` host slots (and ``disk_blocks`` disk ones) for the tiny
    preset's layout, stores under ``tmp``; what the manager sizes and hands out."""
    layout = layout_id(SPEC, MODEL).hex()
    memory = (host_blocks + 1) * (-(-(64 + BLOCK_BYTES) // 64) * 64)
    slots = host_slots(BLOCK_BYTES, memory)
    disk_bytes = disk_blocks * (64 + BLOCK_BYTES)
    dslots = disk_slots(BLOCK_BYTES, disk_bytes) if disk_blocks else 0
    Path(host_file(str(tmp), layout)).unlink(missing_ok=True)
    info = NodeTierInfo(layout, str(tmp), slots, str(tmp / "disk") if disk_blocks else None, disk_bytes, dslots, policy)
    return NodeTier(slots, dslots, 16, BLOCK_BYTES, policy=policy, **kw), info  # type: ignore[arg-type]


def tp_node_tier(tmp: Path, host_blocks: int, world: int = 2, disk_blocks: int = 0,
                 policy: str = "demote") -> tuple[NodeTier, NodeTierInfo]:
    """The node tier of the tiny preset sharded over ``world`` tensor-parallel ranks: one
    bookkeeping, one store per rank (of that rank's heads), as the manager sizes it."""
    spec = KVSpec(16, TINY.num_layers, TINY.num_kv_heads // world, TINY.head_size, "float32")
    tiers = NodeTiers(None)
    settings = NodeTierSettings((host_blocks + 1) * host_stride(spec.block_bytes) * world, str(tmp),
                                str(tmp / "disk") if disk_blocks else None,
                                disk_blocks * (64 + spec.block_bytes) * world, policy)
    stores = shard_stores(spec, MODEL, world)
    for s in stores:
        Path(host_file(str(tmp), s)).unlink(missing_ok=True)
    info = tiers.join(stores[0], 16, spec.block_bytes, settings, stores)
    assert info is not None and info.host_slots == host_blocks + 1
    tiers.ensure_files(stores[0])
    return tiers.tiers[stores[0]], info


def node_engine(tier: tuple[NodeTier, NodeTierInfo], pool: str, device_blocks: int = 64, **cfg: object) -> Engine:
    cfg.setdefault("max_model_len", 256)
    wc = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=256 * BLOCK_BYTES,
                      **cfg)  # type: ignore[arg-type]
    return build_engine(wc, LocalBlockManager(pool, max_blocks=device_blocks, node_tier=tier))


def settle(*engines: Engine) -> None:
    """Runs each engine until it has nothing left, its node-tier reports included."""
    for e in engines:
        while e.has_work():
            e.step()
