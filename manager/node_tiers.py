"""The manager's node tiers: one per KV layout of the pools it serves, created when the first
worker of a layout registers (shared/node_tier.py says what a layout is).

A tier is the bookkeeping (manager/core/node_tier.py); its bytes are in files every worker of
the layout maps (worker/node_store.py): one shared-memory file of ``memory_bytes`` under
``host_dir`` (``/dev/shm`` by default) and, with a disk level, one file per slot under
``disk_dir/<layout>/`` within ``disk_bytes``. The manager creates them (so every worker finds
them sized as its slot count says) and never reads a block.

A tier starts empty. Whatever its files hold from an earlier manager (a restart without a
persistent store) is never trusted: the host file is kept when its size fits (workers that
still map it keep their mapping) but no slot of it is indexed, and the disk level's files are
removed. A slot becomes loadable only once a worker wrote it under this index and reported the
write done; every read verifies the slot's checksum, layout and key besides.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvpool.manager.core.node_tier import NodeTier
from kvpool.shared.node_tier import NodeTierInfo, disk_slots, host_file, host_slots, host_stride

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeTierSettings:
    """The manager config's node-tier fields (manager/config.py validates them)."""

    memory_bytes: int
    host_dir: str = "/dev/shm"
    disk_dir: str | None = None
    disk_bytes: int = 0
    policy: str = "demote"
    admit_hits: int | None = None
    pin_share: float = 0.25
    max_layouts: int = 4


class NodeTiers:
    def __init__(self, settings: NodeTierSettings, kv_events: bool = False) -> None:
        self.settings = settings
        self.kv_events = kv_events
        self.tiers: dict[str, NodeTier] = {}  # layout (hex) -> its tier
        self.info: dict[str, NodeTierInfo] = {}
        self.refused: set[str] = set()  # layouts served without a node tier (logged once)

    def join(self, layout: str, block_size: int, block_bytes: int) -> NodeTierInfo | None:
        """The tier of ``layout``, created (with its files) on first use; None when the
        settings leave no room for it (logged once: the pool is served without one)."""
        info = self.info.get(layout)
        if info is not None:
            return info
        s = self.settings
        slots = host_slots(block_bytes, s.memory_bytes)
        why = None
        if len(self.tiers) >= s.max_layouts:
            why = f"{s.max_layouts} layouts have node tiers already (node_tier_max_layouts)"
        elif slots < 2:
            why = (f"node_tier_memory {s.memory_bytes} bytes holds no block of {block_bytes} bytes: raise it to at "
                   f"least {2 * host_stride(block_bytes)}")
        if why is not None:
            if layout not in self.refused:
                logger.warning("layout %s gets no node tier: %s", layout, why)
                self.refused.add(layout)
            return None
        dslots = disk_slots(block_bytes, s.disk_bytes) if s.disk_dir else 0
        if s.disk_dir and dslots < 2:
            logger.warning("layout %s: node_tier_disk_size %d holds no block of %d bytes: no disk level",
                           layout, s.disk_bytes, block_bytes)
            dslots = 0
        self._prepare(layout, slots, block_bytes, dslots)
        info = NodeTierInfo(layout, s.host_dir, slots, s.disk_dir if dslots else None,
                            s.disk_bytes if dslots else 0, dslots, s.policy)
        self.tiers[layout] = NodeTier(slots, dslots, block_size, block_bytes, policy=s.policy,
                                      admit_hits=s.admit_hits, pin_share=s.pin_share, enable_events=self.kv_events)
        self.info[layout] = info
        logger.info("node tier of layout %s: %d host blocks in %s, %s", layout, slots - 1,
                    host_file(s.host_dir, layout), f"{dslots - 1} disk blocks in {s.disk_dir}" if dslots else "no disk")
        return info

    def _prepare(self, layout: str, slots: int, block_bytes: int, dslots: int) -> None:
        """The host file, sized (kept when it already is: nothing in it is indexed), and an
        emptied disk directory."""
        path = host_file(self.settings.host_dir, layout)
        size = slots * host_stride(block_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, 0)  # a stale size: nothing of it is kept
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        if dslots:
            d = Path(self.settings.disk_dir) / layout  # type: ignore[arg-type]
            d.mkdir(parents=True, exist_ok=True)
            stale = [e.path for e in os.scandir(d) if e.is_file() and e.name.endswith((".kv", ".tmp"))]
            for p in stale:
                os.unlink(p)
            if stale:
                logger.info("layout %s: %d disk blocks of an earlier index dropped", layout, len(stale))

    def abandon(self, sid: str) -> None:
        """A session ended: its batches' copies are in an unknown state (manager/core/node_tier.py)."""
        for tier in self.tiers.values():
            for owner in [o for o in tier.batches if type(o) is tuple and o[0] == sid]:
                tier.abandon(owner)

    def usage(self) -> dict:
        return {layout: {**tier.usage(), "host_file": host_file(self.settings.host_dir, layout),
                         "disk_dir": self.info[layout].disk_dir}
                for layout, tier in self.tiers.items()}

    def check_invariants(self) -> None:
        for tier in self.tiers.values():
            tier.check_invariants()
