"""The host tier of a pool: host-memory blocks behind the device blocks.

Pure Python, no I/O. The tier is a second ``BlockPool`` (its ref counts, free queue and
``hash -> host block`` map, the same invariants), driven by a different rule: a host block is
referenced only while a copy that touches it is in flight in the current step (a *pin*), and is
otherwise free, hashed blocks in LRU order behind unhashed ones. ``end_step`` drops the pins.

Policy: demote at eviction. A cached device block about to be handed out again is first saved
to a host block (``demote``), and the host tier evicts in LRU order. The alternative, write
through (save every block as it becomes full), would keep the host tier a superset of the device
one, but it costs one device-to-host copy per full block on every step's critical path, most of
them for blocks that are reused or freed long before they would be evicted; demotion copies only
what is about to be lost, so the copy traffic is bounded by the eviction rate, and the host
capacity holds only blocks the device no longer has (no duplicate of the device tier).

Ordering within one step (the worker runs every save, then every load, then the forward pass):
  * a save reads its device block before the allocation that evicted it writes there: saves
    run first;
  * no load reads a host block that the same step overwrites: a block being loaded or saved is
    pinned (ref > 0) for the rest of the step, so ``demote`` never picks it (``get_new_blocks``
    takes free blocks only);
  * a save whose hash is already in the host tier copies nothing (the host copy is the same
    tokens: the hash stands for them).

Invariants (``check_invariants``): the block pool's own (free queue, map, duplicates), and every
host block's ref count equals the pins this step holds on it (0 between steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvpool.manager.core.block_pool import BlockPool, InvariantBroken
from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent


@dataclass(frozen=True)
class Copy:
    """One block copy the worker makes before the step's forward pass."""

    src: int  # save: device block; load: host block
    dst: int  # save: host block; load: device block


@dataclass
class HostStats:
    saves: int = 0  # device -> host copies ordered
    saves_skipped: int = 0  # demotions of a hash the host tier already held
    saves_dropped: int = 0  # demotions with every host block pinned: the hash is lost
    loads: int = 0  # host -> device copies ordered
    hit_tokens: int = 0  # prompt tokens served by loads


class HostTier:
    def __init__(self, num_blocks: int, block_size: int, enable_events: bool = False) -> None:
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks, True, enable_events)
        self.pinned: list[int] = []  # host blocks referenced by this step's copies
        self._cleared: list[list[bytes]] = []  # hashes of each reset, for its event
        self.stats = HostStats()

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def take_events(self) -> list[KVEvent]:
        """The host map's KV events since the last call, with ``medium: "CPU"``; a host reset is
        the removal of its hashes (vLLM's AllBlocksCleared names no medium: it would clear both)."""
        out: list[KVEvent] = []
        for ev in self.blocks.take_events():
            if isinstance(ev, AllBlocksCleared):
                hashes = self._cleared.pop(0) if self._cleared else []
                if hashes:
                    out.append(BlockRemoved(hashes, "CPU"))
            else:
                out.append(replace(ev, medium="CPU"))
        return out

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Host blocks of the longest prefix of ``hashes`` the host tier holds (no side effects)."""
        return self.blocks.lookup(hashes)

    def demote(self, device_block: int, h: bytes, parent: bytes | None) -> Copy | None:
        """A save order for a cached device block about to be reused, or None when there is
        nothing to copy (the host tier holds ``h`` already; every host block is pinned)."""
        bp = self.blocks
        held = bp.cached.get(h)
        if held is not None:
            if bp.ref_cnt[held] == 0:  # seen again: most recently used
                bp.touch([held])
                bp.free_blocks([held])
            self.stats.saves_skipped += 1
            return None
        if bp.num_free == 0:
            self.stats.saves_dropped += 1
            return None
        (hb,) = bp.get_new_blocks(1)  # unhashed first, else the LRU host block loses its hash
        bp.cache_blocks([hb], [h], parent)
        self.pinned.append(hb)
        self.stats.saves += 1
        return Copy(device_block, hb)

    def pin(self, host_blocks: Sequence[int]) -> None:
        """Pins ``host_blocks`` (from ``lookup``) until ``end_step``: no demotion of this step
        overwrites them. Pin before taking the device blocks to load into (that may demote)."""
        self.blocks.touch(host_blocks)
        self.pinned.extend(host_blocks)

    def load(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> list[Copy]:
        """Load orders for pinned ``host_blocks`` into fresh ``device_blocks``."""
        if len(host_blocks) != len(device_blocks):
            raise ValueError(f"{len(host_blocks)} host blocks to load into {len(device_blocks)} device blocks")
        for hb in host_blocks:
            if self.blocks.ref_cnt[hb] == 0:
                raise InvariantBroken(f"host block {hb} loaded without a pin: a demotion could overwrite it")
        self.stats.loads += len(host_blocks)
        self.stats.hit_tokens += len(host_blocks) * self.block_size
        return [Copy(hb, d) for hb, d in zip(host_blocks, device_blocks)]

    def end_step(self) -> None:
        """The step's copies are ordered: its pins end (the blocks keep their hashes, LRU last)."""
        self.blocks.free_blocks(self.pinned)
        self.pinned = []

    def evict(self, n: int) -> int:
        """Drops up to ``n`` host hashes, LRU first (admin ``evict --tier host``)."""
        return self.blocks.evict(n)

    def reset(self) -> bool:
        """Forgets every host hash; refused (False) while a copy of this step pins a block."""
        hashes = list(self.blocks.cached)
        if not self.blocks.reset_prefix_cache():
            return False
        if self.blocks.events_enabled:
            self._cleared.append(hashes)
        return True

    def usage(self) -> dict:
        bp = self.blocks
        return {"host_num_blocks": bp.num_blocks, "host_cached_blocks": len(bp.cached),
                "host_free_blocks": bp.num_free, "host_hit_tokens": self.stats.hit_tokens,
                "host_saves": self.stats.saves, "host_loads": self.stats.loads}

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        pins: dict[int, int] = {}
        for b in self.pinned:
            pins[b] = pins.get(b, 0) + 1
        for b in range(1, self.num_blocks):
            if self.blocks.ref_cnt[b] != pins.get(b, 0):
                raise InvariantBroken(f"host block {b}: ref_cnt {self.blocks.ref_cnt[b]} but "
                                      f"{pins.get(b, 0)} pins this step")
