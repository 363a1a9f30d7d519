"""The node tier's admin side: evict and reset by level, KV events, stats, invariants.

A base of ``NodeTier`` (manager/core/node_tier.py), split off to keep that file to the data
path; it reads the tier's levels, batches and pins and records removals through it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent
from kvpool.manager.core.node_level import NodeLevel
from kvpool.manager.core.retention import PinTable

MAX_REMOVALS = 4096  # removals kept for take_removals (a caller that never takes them holds no more)


@dataclass(frozen=True, slots=True)
class Removal:
    """A hash left ``level`` (for KV events and stats): ``reason`` is one of node_level.REASONS."""

    level: str
    key: bytes
    reason: str


class NodeTierAdmin:
    # set by NodeTier.__init__
    policy: str
    admit_hits: int
    levels: dict[str, NodeLevel]
    host: NodeLevel
    disk: NodeLevel | None
    pins: PinTable
    batches: dict
    expired: set[bytes]
    removals: deque[Removal]
    _cleared: dict[str, list[list[bytes]]]
    _restated: bool

    def _removed(self, lv: NodeLevel, h: bytes, reason: str) -> None:
        if reason == "evicted" and h in self.expired:
            reason = "expired_pin"
        if not any(other.holds(h) for other in self.levels.values() if other is not lv):
            self.expired.discard(h)
        lv.stats.removed[reason] += 1
        self.removals.append(Removal(lv.name, h, reason))

    def set_events(self, enabled: bool) -> None:
        """Whether the levels queue KV events (a tier recovered from a store is loaded with them on)."""
        for lv in self.levels.values():
            lv.blocks.set_events(enabled)

    def take_removals(self) -> list[Removal]:
        """The removals since the last call (the last ``MAX_REMOVALS``: the stats count them all)."""
        out = list(self.removals)
        self.removals.clear()
        return out

    def evict(self, level: str, n: int) -> int:
        """Drops up to ``n`` hashes of ``level`` in eviction order (admin ``evict --tier``)."""
        lv, done = self._level(level), 0
        while done < n:
            h = lv.evict_one()
            if h is None:
                break
            self._removed(lv, h, "demoted" if lv is self.host and self.disk is not None
                          and self.disk.holds(h) else "evicted")
            done += 1
        return done

    def reset(self, level: str) -> bool:
        """Forgets every hash of ``level``; refused (False) while a batch references a slot."""
        lv = self._level(level)
        hashes = lv.clear()
        if hashes is None:
            return False
        for h in hashes:
            self._removed(lv, h, "cleared")
        if lv.blocks.events_enabled:
            self._cleared[level].append(hashes)
        return True

    def _level(self, level: str) -> NodeLevel:
        lv = self.levels.get(level)
        if lv is None:
            raise ValueError(f"the node tier has no {level!r} level (levels: {sorted(self.levels)})")
        return lv

    def restate_events(self) -> None:
        """Replaces the queued events with what a subscriber needs to match the tier whatever it
        saw before (a recovered state): one AllBlocksCleared, then every hash of each level."""
        if not self.host.blocks.events_enabled:
            return
        self._restated = True
        for name, lv in self.levels.items():
            self._cleared[name] = [[]]  # the level's own clear names no hash: the tier's one clears all
            lv.blocks.restate_events()

    def take_events(self) -> list[KVEvent]:
        """Each level's KV events with its medium ("CPU", "DISK"); a level's reset is the
        removal of its hashes (vLLM's AllBlocksCleared names no medium, so it would clear the
        other level too); a restatement starts with one AllBlocksCleared."""
        out: list[KVEvent] = [AllBlocksCleared()] if self._restated else []
        self._restated = False
        for name, lv in self.levels.items():
            for ev in lv.blocks.take_events():
                if isinstance(ev, AllBlocksCleared):
                    hashes = self._cleared[name].pop(0) if self._cleared[name] else []
                    if hashes:
                        out.append(BlockRemoved(hashes, lv.medium))
                else:
                    out.append(replace(ev, medium=lv.medium))
        return out

    def usage(self) -> dict:
        out: dict = {"policy": self.policy, "admit_hits": self.admit_hits, "pins": len(self.pins.pins),
                     "batches": len(self.batches)}
        for name, lv in self.levels.items():
            s, bp = lv.stats, lv.blocks
            out[name] = {"num_blocks": bp.num_blocks, "bytes": (bp.num_blocks - 1) * lv.block_bytes,
                         "cached_blocks": len(bp.cached), "retained_blocks": len(lv.retained),
                         "hits": s.hits, "saves": s.saves, "saves_skipped": s.saves_skipped,
                         "saves_dropped": s.saves_dropped, "save_failures": s.save_failures,
                         "loads": s.loads, "verify_failures": s.verify_failures, "deadline_misses": s.deadline_misses,
                         "bytes_saved": s.saves * lv.block_bytes, "bytes_loaded": s.loads * lv.block_bytes,
                         "removed": dict(s.removed)}
        return out

    def check_invariants(self) -> None:
        problems = self.pins.check()
        if problems:
            raise InvariantBroken("; ".join(problems))
        pinned = frozenset(self.pins.count)
        open_batches = {id(batch) for batch in self.batches.values()}
        for name, lv in self.levels.items():
            refs: dict[int, int] = {}
            for batch in self.batches.values():
                for (n, b), k in batch.refs.items():
                    if n == name:
                        refs[b] = refs.get(b, 0) + k
            for b, batch in lv.landing.items():
                if id(batch) not in open_batches or (name, b) not in batch.refs:  # type: ignore[operator]
                    raise InvariantBroken(f"{name} slot {b} landing for a batch that is not open")
            lv.check_invariants(refs, pinned, self.pins.limits[name])
