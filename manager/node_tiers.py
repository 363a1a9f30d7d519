"""The manager's node tiers: one per KV layout of the pools it serves, created when the first
worker of a layout registers (shared/node_tier.py says what a layout is).

A tier is the bookkeeping (manager/core/node_tier.py); its bytes are in files every worker of
the layout maps (worker/node_store.py): one shared-memory file of ``memory_bytes`` under
``host_dir`` (``/dev/shm`` by default) and, with a disk level, one file per slot under
``disk_dir/<layout>/`` within ``disk_bytes``. The manager creates them (so every worker finds
them sized as its slot count says) and never reads a block.

Files and the index. ``join`` and a recovery's ``adopt`` change only the bookkeeping (a journal's
replay runs ``join`` again and must touch no file); the files follow in ``ensure_files``, once
per layout and process, before a worker is told where the tier lives (register's reply) or a
recovered state serves: the host file is sized as the index says (kept when it already is, so
workers that map it keep their mapping), and of the disk level's files only those of slots the
index names are kept; the others (and writers' temporary files) are removed. A new tier names
no slot, so whatever an earlier manager left is dropped; a tier recovered from Redis keeps the
files its index names, and nothing in them is trusted: every read verifies the slot's layout,
key and checksum (worker/node_store.py), and one that does not is recomputed and its hash
dropped (the lazy re-verification a restart needs, at the cost of one read per block it uses).
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
    """The manager config's node-tier fields (manager/config.py validates them). A registration
    is journaled with the settings it joined under (``to_wire``), so a replay creates the tier
    the live manager did, whatever the restarted one is configured with."""

    memory_bytes: int
    host_dir: str = "/dev/shm"
    disk_dir: str | None = None
    disk_bytes: int = 0
    policy: str = "demote"
    admit_hits: int | None = None
    pin_share: float = 0.25
    max_layouts: int = 4

    def to_wire(self) -> list:
        return [self.memory_bytes, self.host_dir, self.disk_dir, self.disk_bytes, self.policy, self.admit_hits,
                self.pin_share, self.max_layouts]

    @classmethod
    def from_wire(cls, raw: object) -> NodeTierSettings:
        """A journaled settings list; TypeError when it is not one."""
        if type(raw) is not list or len(raw) != 8:
            raise TypeError(f"node tier settings: a list of 8, got {str(raw)[:80]}")
        memory, host_dir, disk_dir, disk_bytes, policy, admit, share, max_layouts = raw
        if (type(memory) is not int or type(host_dir) is not str or (disk_dir is not None and type(disk_dir) is not str)
                or type(disk_bytes) is not int or type(policy) is not str or (admit is not None and type(admit) is not int)
                or type(share) not in (int, float) or type(max_layouts) is not int):
            raise TypeError(f"node tier settings: a field of the wrong type in {str(raw)[:120]}")
        return cls(memory, host_dir, disk_dir, disk_bytes, policy, admit, float(share), max_layouts)


class NodeTiers:
    def __init__(self, settings: NodeTierSettings | None, kv_events: bool = False) -> None:
        # None: this manager runs no node tier; tiers recovered from a store serve on (their
        # pools keep them), registrations make none
        self.settings = settings
        self.kv_events = kv_events
        self.tiers: dict[str, NodeTier] = {}  # layout (hex) -> its tier
        self.info: dict[str, NodeTierInfo] = {}
        self.refused: set[str] = set()  # layouts served without a node tier (logged once)
        self.ready: set[str] = set()  # layouts whose files this process has set up (ensure_files)

    def join(self, layout: str, block_size: int, block_bytes: int, s: NodeTierSettings,
             stores: tuple[str, ...] = ()) -> NodeTierInfo | None:
        """The tier of ``layout``, created under settings ``s`` on first use (its files follow
        in ``ensure_files``); None when they leave no room for it (logged once: the pool is
        served without one). ``stores``: a tensor-parallel pool's per-rank stores
        (shared/node_tier.py), each of ``block_bytes`` blocks (one rank's share); the budgets
        are split between them, so a slot costs what a whole block does."""
        info = self.info.get(layout)
        if info is not None:
            return info
        world = len(stores) or 1
        memory, disk_bytes = s.memory_bytes // world, s.disk_bytes // world
        slots = host_slots(block_bytes, memory)
        why = None
        if len(self.tiers) >= s.max_layouts:
            why = f"{s.max_layouts} layouts have node tiers already (node_tier_max_layouts)"
        elif slots < 2:
            why = (f"node_tier_memory {s.memory_bytes} bytes holds no block of {world} x {block_bytes} bytes: raise "
                   f"it to at least {2 * world * host_stride(block_bytes)}")
        if why is not None:
            if layout not in self.refused:
                logger.warning("layout %s gets no node tier: %s", layout, why)
                self.refused.add(layout)
            return None
        dslots = disk_slots(block_bytes, disk_bytes) if s.disk_dir else 0
        if s.disk_dir and dslots < 2:
            logger.warning("layout %s: node_tier_disk_size %d holds no block of %d x %d bytes: no disk level",
                           layout, s.disk_bytes, world, block_bytes)
            dslots = 0
        info = NodeTierInfo(layout, s.host_dir, slots, s.disk_dir if dslots else None,
                            disk_bytes if dslots else 0, dslots, s.policy, stores)
        self.tiers[layout] = NodeTier(slots, dslots, block_size, block_bytes, policy=s.policy,
                                      admit_hits=s.admit_hits, pin_share=s.pin_share, enable_events=self.kv_events)
        self.info[layout] = info
        logger.info("node tier of layout %s%s: %d host blocks in %s, %s", layout,
                    f" ({world} tensor-parallel stores)" if stores else "", slots - 1, host_file(s.host_dir, layout),
                    f"{dslots - 1} disk blocks in {s.disk_dir}" if dslots else "no disk")
        return info

    def adopt_tier(self, info: NodeTierInfo, tier: NodeTier) -> None:
        """A tier recovered from a snapshot (its files follow in ``ensure_files``)."""
        tier.set_events(self.kv_events)
        self.tiers[info.layout], self.info[info.layout] = tier, info

    def set_events(self, enabled: bool) -> None:
        self.kv_events = enabled
        for tier in self.tiers.values():
            tier.set_events(enabled)

    def clear(self) -> None:
        """Forgets every tier (a state started over: no pool uses one any more)."""
        self.tiers, self.info, self.refused, self.ready = {}, {}, set(), set()

    def ensure_files(self, layout: str | None = None) -> None:
        """Sets up the files of ``layout``'s tier (every tier's: None) once per process: the
        host file sized, the disk files its index does not name removed (module docstring)."""
        for name in [layout] if layout is not None else list(self.tiers):
            if name in self.ready or name not in self.tiers:
                continue
            info, tier = self.info[name], self.tiers[name]
            named = ({b for b in range(1, tier.disk.num_blocks) if tier.disk.blocks.block_hash[b] is not None}
                     if tier.disk is not None and info.disk_dir is not None else None)
            for rank in range(info.world):  # a tensor-parallel pool's: one store per rank
                store = info.store(rank)
                kept = _prepare_host(info, store, tier.host.block_bytes)
                if named is not None:
                    dropped = _prepare_disk(Path(info.disk_dir) / store, named)  # type: ignore[arg-type]
                    logger.info("store %s: %d disk blocks the index names kept (each verified when read), %d "
                                "dropped%s", store, len(named), dropped, "" if kept else "; host memory was not "
                                "there: its slots fail their checks and are recomputed")
            self.ready.add(name)

    def pairs(self) -> list[tuple[NodeTierInfo, NodeTier]]:
        return [(self.info[layout], tier) for layout, tier in self.tiers.items()]

    def abandon(self, sid: str) -> None:
        """A session ended: its batches' copies are in an unknown state (manager/core/node_tier.py)."""
        for tier in self.tiers.values():
            for owner in [o for o in tier.batches if type(o) is tuple and o[0] == sid]:
                tier.abandon(owner)
            tier.leave_engine(sid)

    def usage(self) -> dict:
        return {layout: {**tier.usage(), "host_file": host_file(self.info[layout].host_dir, layout),
                         "disk_dir": self.info[layout].disk_dir}
                for layout, tier in self.tiers.items()}

    def check_invariants(self) -> None:
        for tier in self.tiers.values():
            tier.check_invariants()


def _prepare_host(info: NodeTierInfo, store: str, block_bytes: int) -> bool:
    """The host level's file of ``store``, sized for ``info``'s slots; True when it was there at
    that size (its slots are kept for the index; else it starts zeroed: every slot uncommitted)."""
    path = host_file(info.host_dir, store)
    size = info.host_slots * host_stride(block_bytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size == size:
            return True
        os.ftruncate(fd, 0)  # a stale size: nothing of it is kept
        os.ftruncate(fd, size)
        return False
    finally:
        os.close(fd)


def _prepare_disk(d: Path, named: set[int]) -> int:
    """Removes the disk level's files of slots not in ``named`` and writers' temporary files;
    returns how many went."""
    d.mkdir(parents=True, exist_ok=True)
    dropped = 0
    for e in os.scandir(d):
        if not e.is_file():
            continue
        keep = e.name.endswith(".kv") and e.name[:-3].isdigit() and int(e.name[:-3]) in named
        if not keep and e.name.endswith((".kv", ".tmp")):
            os.unlink(e.path)
            dropped += 1
    return dropped
