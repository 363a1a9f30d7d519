"""The host tier of a pool: host-memory blocks behind the device blocks.

Pure Python, no I/O. The tier is a second ``BlockPool`` (its ref counts, free queue and
``hash -> host block`` map, the same invariants), driven by a different rule: a host block is
referenced only while a copy that touches it is in flight in the current step (a *pin*), and is
otherwise free, hashed blocks in LRU order behind unhashed ones. ``end_step`` drops the pins.

Policy, a pool-level choice (``policy``: the worker's ``--host-kv-policy``, register's
``host_kv_policy``):
  * ``demote`` (the default): a cached device block about to be handed out again is first saved
    to a host block (``demote``); the host tier evicts in LRU order.
  * ``write_through``: every device block is also given a host block in the step it becomes full
    (``write``; the worker copies it after that step's forward pass, which computes it). Eviction
    then copies nothing, except a hash the host tier dropped since (demoted as above).
Why demote is the default, measured (scripts/bench_tier.py, small preset; README, *Host tier*):
a hashed block reaches the host tier about once under either policy (when it fills, or when it
is evicted), so the copy traffic on the step's critical path is the same (4.0 blocks, 256 KiB
per step on the bench's cyclic trace, under 1% of the CPU worker's time either way) and, with a
host tier that holds the whole set of prefixes, so is the hit rate (0.65). But write-through
keeps a host copy of every device block (29 of the host blocks duplicate device ones on average,
against 19 under demote, whose loads leave their host copy in place), so its capacity is the
host's alone: with a host tier about twice the device tier (the set fits device + host, not the
host alone), write-through's LRU cycle kept nothing (hit rate 0.00, as device only) where demote
kept 0.20. On scripts/bench_memory.py's long-tailed trace (2,000 requests, paged+host) both
reach the same hit rate, but write-through copies more to the host tier: 160 against 147 GiB
with a host tier 4x the device, 221 against 150 GiB with 1x (host copies of blocks the device
keeps hitting age out of the host LRU and are saved again at eviction). Write-through would pay
off where a save at eviction delays the forward pass and a write after it does not (a copy
engine with idle time after the forward); on the CPU worker both are synchronous.

Ordering within one step (the worker runs every save, then every load, then the forward pass,
then every write):
  * a save reads its device block before the allocation that evicted it writes there: saves
    run first;
  * no load reads a host block that the same step overwrites: a block being loaded or saved is
    pinned (ref > 0) for the rest of the step, so ``demote`` and ``write`` never pick it
    (``get_new_blocks`` takes free blocks only);
  * no load reads a host block written through in the same step (its tokens exist only after
    the forward): ``lookup`` stops before it; and a write whose device block is handed out again
    within the step (its request freed first) is withdrawn: the host block loses its hash;
  * a save or write whose hash is already in the host tier copies nothing (the host copy is the
    same tokens: the hash stands for them).

Invariants (``check_invariants``): the block pool's own (free queue, map, duplicates), every
host block's ref count equals the pins this step holds on it (0 between steps), and every host
block being written through is pinned and hashed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvpool.manager.core.block_pool import BlockPool, InvariantBroken
from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent
from kvpool.shared.protocol import HOST_POLICIES


@dataclass(frozen=True)
class Copy:
    """One block copy the worker makes: a save or load before the step's forward pass, a write
    after it."""

    src: int  # save, write: device block; load: host block
    dst: int  # save, write: host block; load: device block


@dataclass
class HostStats:
    saves: int = 0  # device -> host copies ordered at eviction (demotions)
    saves_skipped: int = 0  # demotions of a hash the host tier already held
    saves_dropped: int = 0  # demotions or writes with every host block pinned: the hash is lost
    loads: int = 0  # host -> device copies ordered
    hit_tokens: int = 0  # prompt tokens served by loads
    writes: int = 0  # device -> host copies ordered when a block became full (write-through)
    writes_skipped: int = 0  # writes of a hash the host tier already held
    writes_withdrawn: int = 0  # writes whose device block was reused in the same step (hash dropped)


class HostTier:
    def __init__(self, num_blocks: int, block_size: int, enable_events: bool = False,
                 policy: str = "demote") -> None:
        if policy not in HOST_POLICIES:
            raise ValueError(f"host tier policy must be one of {HOST_POLICIES}, got {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.blocks = BlockPool(num_blocks, True, enable_events)
        self.pinned: list[int] = []  # host blocks referenced by this step's copies
        self.writing: dict[int, int] = {}  # device block -> host block: this step's writes (after the forward)
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

    def restate_events(self) -> None:
        """Replaces the queued events with one store of every host hash (``medium: "CPU"``). It
        follows the device tier's restatement (``Pool.restate_events``), whose AllBlocksCleared
        already cleared both tiers for a subscriber, so the host's own clear is dropped."""
        if not self.blocks.events_enabled:
            return
        self._cleared = [[]]  # the clear below names no hash: take_events turns it into nothing
        self.blocks.restate_events()

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Host blocks of the longest prefix of ``hashes`` the host tier holds and can be read
        before this step's forward pass (no side effects): a block this step writes through
        holds its tokens only after the forward, so the prefix stops there."""
        hits = self.blocks.lookup(hashes)
        if self.writing and hits:
            written = set(self.writing.values())
            for i, hb in enumerate(hits):
                if hb in written:
                    return hits[:i]
        return hits

    def demote(self, device_block: int, h: bytes, parent: bytes | None) -> Copy | None:
        """A save order for a cached device block about to be reused, or None when there is
        nothing to copy (the host tier holds ``h`` already; every host block is pinned)."""
        if self._holds(h):
            self.stats.saves_skipped += 1
            return None
        hb = self._take(h, parent)
        if hb is None:
            return None
        self.stats.saves += 1
        return Copy(device_block, hb)

    def write(self, device_block: int, h: bytes, parent: bytes | None) -> Copy | None:
        """Write-through: a copy order, run after this step's forward pass (which computes the
        block's K/V), for a device block that just became full; None when the host tier holds
        ``h`` already or every host block is pinned. The host block is unreadable (``lookup``)
        until the step ends."""
        if self._holds(h):
            self.stats.writes_skipped += 1
            return None
        hb = self._take(h, parent)
        if hb is None:
            return None
        self.writing[device_block] = hb
        self.stats.writes += 1
        return Copy(device_block, hb)

    def withdraw(self, device_block: int) -> None:
        """The device block a write of this step reads is handed out again within the same step
        (its request was freed after it became full): its host block would receive other
        tokens, so it loses its hash now. It stays pinned to the step's end, so no demotion or
        load of this step touches it; the write still runs, into a block nobody reads."""
        hb = self.writing.pop(device_block, None)
        if hb is not None:
            self.blocks.uncache(hb)
            self.stats.writes_withdrawn += 1

    def forget(self, device_block: int, h: bytes) -> None:
        """Device block ``device_block`` loses hash ``h`` because its K/V was never written (its
        request was freed before the step that computes it ran): a write-through copy of it
        holds nothing valid either, so the host tier drops ``h`` (a copy it held from before
        goes too: it cannot tell them apart, and a dropped hash is only a miss)."""
        if device_block in self.writing:
            self.withdraw(device_block)
            return
        bp = self.blocks
        hb = bp.cached.get(h)
        if hb is None:
            return
        if bp.ref_cnt[hb]:  # pinned by a copy of this step
            bp.uncache(hb)
            return
        bp.touch([hb])  # out of the LRU segment, its hash dropped, back at the unhashed front
        bp.uncache(hb)
        bp.free_blocks([hb])

    def _holds(self, h: bytes) -> bool:
        """True when ``h`` is in the host tier already; a free holder becomes most recently used."""
        bp = self.blocks
        held = bp.cached.get(h)
        if held is None:
            return False
        if bp.ref_cnt[held] == 0:  # seen again: most recently used
            bp.touch([held])
            bp.free_blocks([held])
        return True

    def _take(self, h: bytes, parent: bytes | None) -> int | None:
        """A free host block, now holding ``h`` and pinned for the step; None when all are pinned."""
        bp = self.blocks
        if bp.num_free == 0:
            self.stats.saves_dropped += 1
            return None
        (hb,) = bp.get_new_blocks(1)  # unhashed first, else the LRU host block loses its hash
        bp.cache_blocks([hb], [h], parent)
        self.pinned.append(hb)
        return hb

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
        self.writing.clear()

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
                "host_saves": self.stats.saves, "host_loads": self.stats.loads,
                "host_writes": self.stats.writes, "host_policy": self.policy}

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        pins: dict[int, int] = {}
        for b in self.pinned:
            pins[b] = pins.get(b, 0) + 1
        for b in range(1, self.num_blocks):
            if self.blocks.ref_cnt[b] != pins.get(b, 0):
                raise InvariantBroken(f"host block {b}: ref_cnt {self.blocks.ref_cnt[b]} but "
                                      f"{pins.get(b, 0)} pins this step")
        for d, hb in self.writing.items():
            if hb not in pins or self.blocks.block_hash[hb] is None:
                raise InvariantBroken(f"host block {hb} written from device block {d} but unpinned or unhashed")
