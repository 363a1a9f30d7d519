"""The node tier for an engine that owns its device blocks (vLLM through kvpool's KV connector,
kvpool/integrations/vllm): lookups, loads and saves without a pool.

Pure Python, no I/O. A kvpool pool's device blocks are the manager's, so its orders name them
(manager/core/pool_node.py). An engine such as vLLM allocates its own blocks, after it asked
what the tier holds: its loads are planned before it knows where they go. So a host ``Load``
of an engine batch names, as ``dst``, the 1-based *position* of its hash in the call's
``hashes``; the engine copies the slot into whatever block it gave that position. A ``Save``
names the engine's own block as ``src`` (it knows it when it asks). Everything else is the
pool path's, through the same ``NodeLink``: the run the tier can bring up now (``plan``: host
hits, and disk hits while host memory has a free slot to prefetch into), held for the batch
before anything can evict it, prefetches and write-downs in the order the engine must run them,
and ``NodeTier.finish`` once the engine reports the batch (failed orders dropped, counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool_node import NodeLink
from kvpool.shared.node_orders import Order


@dataclass
class _Hits:
    """The per-pool hit counts a link keeps (pool_node.py ``HitCounts``): an engine has no pool
    to keep them, and vLLM counts its external hits itself."""

    node_host_hit_tokens: int = 0
    node_disk_hit_tokens: int = 0


def _link(tier: NodeTier) -> NodeLink:
    return NodeLink(tier, tier.block_size, _Hits())


def engine_plan(tier: NodeTier, hashes: Sequence[bytes]) -> int:
    """How many leading ``hashes`` the tier can bring up now (no side effects)."""
    return len(_link(tier).plan(hashes))


def engine_load(tier: NodeTier, owner: object, hashes: Sequence[bytes], priority: int = 0) -> tuple[int, list[Order]]:
    """Holds the run ``plan`` finds for ``owner``'s batch: how many leading hashes, and the
    orders (prefetches disk -> host, then loads host -> position, write-downs) in run order."""
    link = _link(tier)
    link.owner, link.priority = owner, priority
    hits = link.plan(hashes)
    if hits:
        host_hits = link.take(hits)
        link.load(host_hits, range(1, len(host_hits) + 1))
    pre, _ = link.take_orders()
    link.end_step()
    return len(hits), pre


def engine_save(tier: NodeTier, owner: object, blocks: Sequence[int], hashes: Sequence[bytes],
                parents: Sequence[bytes | None], priority: int = 0) -> list[Order]:
    """Saves of the engine's computed ``blocks`` (each holding the hash beside it; ``parents``:
    the hash before it in its prefix, None for a first block) to host memory, with the
    write-downs the policy asks for: nothing for a hash host memory holds already."""
    if not len(blocks) == len(hashes) == len(parents):
        raise ValueError(f"{len(blocks)} blocks, {len(hashes)} hashes and {len(parents)} parents")
    link = _link(tier)
    link.owner, link.priority = owner, priority
    for b, h, parent in zip(blocks, hashes, parents):
        link.write([b], [h], parent)
    _, post = link.take_orders()
    link.end_step()
    return post
