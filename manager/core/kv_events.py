"""The block pool's KV events: what a subscriber needs to mirror the prefix cache.

The pool queues them as its cache changes and hands them out once, through
``BlockPool.take_events``; the daemon publishes them in vLLM's wire format (manager/events.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Blocks became full and entered the map: ``hashes`` in chain order, ``parent`` before them."""

    hashes: list[bytes]
    parent: bytes | None
    medium: str = "GPU"  # "CPU": the pool's host tier (manager/core/host_tier.py)


@dataclass(frozen=True)
class BlockRemoved:
    """Hashes left the map (their last block was handed out again, or evicted)."""

    hashes: list[bytes]
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash is gone (a reset, a restarted shard, a recovered state about to be restated)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
