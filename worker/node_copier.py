"""The worker's side of the node tier: runs a step's node-tier orders between its KV tensors
and the node's stores, verifying every block it reads, and recomputes what did not verify.

The manager hands the orders out (manager/core/pool_node.py) and keeps the bookkeeping; the
bytes live in the stores every worker of the layout maps (worker/node_store.py). A step's orders
come in two lists (shared/node_orders.py ``NodeOrders``), run in the order given:

  * ``pre``, before the forward pass: saves of device blocks being reused (device -> host),
    write-downs (host -> disk: the host slot is read verified first), prefetches (disk -> host,
    verified) and loads (host -> device, verified). Device blocks are read before any is
    written: every save's block is gathered first (a save never reads a block a load of the
    same step writes: the manager saves a block before it is handed out again, and never saves
    a block handed out in the same step), and the loads are scattered last.
  * ``post``, after it: saves of the blocks the forward pass filled. A save of a block the
    forward did not fill (its sequence left the batch: finished, aborted, preempted) is not run
    and reported failed, so no other tokens are ever stored under its hash.

Every order that does not land (a read that does not verify: a flipped byte, a torn or missing
slot, a block of another layout or key; a write to a full disk) is reported to the manager in
the step's ``NodeReport``, which drops the hash from that level. A load into the device that
did not verify leaves its block zeroed (node_store.py), never served: ``recompute`` moves each
sequence that reads such a block back to its start, so this very forward pass computes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvpool.shared.node_orders import Load, Order, Save
from kvpool.shared.node_tier import NodeTierInfo
from kvpool.worker.node_store import DiskStore, Failure, HostStore, NodeStoreError, StoreLayout
from kvpool.worker.step_plan import Batch

logger = logging.getLogger(__name__)


@dataclass
class NodeCopyStats:
    """What the node tier's copies did on this worker: blocks by kind and level, failures by
    reason, tokens recomputed because a load did not verify, time spent."""

    saves: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    failures: dict[str, int] = field(default_factory=dict)  # Failure.reason (+ "not_computed") -> count
    recomputed_tokens: int = 0
    wall_s: float = 0.0

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1


class NodeCopier:
    """One layout's stores, mapped by this worker, and the copies of its steps."""

    def __init__(self, device_caches: list[torch.Tensor], info: NodeTierInfo, layout: StoreLayout) -> None:
        if layout.name != info.layout:
            raise NodeStoreError(f"the manager's node tier is for layout {info.layout}, this worker's blocks are "
                                 f"layout {layout.name}: a different model, dtype or block shape")
        self.info, self.layout, self.device_caches = info, layout, device_caches
        self.device = device_caches[0].device
        self.host = HostStore(layout, info.host_slots, info.host_dir)
        self.disk: DiskStore | None = None
        if info.disk_dir is not None:
            # no fsync: a file the rename committed but a power loss tore fails its checksum on
            # read and is recomputed, so an fsync per block (milliseconds on the step's critical
            # path) buys nothing a cache needs
            self.disk = DiskStore(layout, info.disk_dir, info.disk_bytes, fsync=False)
            if self.disk.num_slots != info.disk_slots:
                raise NodeStoreError(f"disk level: {self.disk.num_slots} slots here, {info.disk_slots} at the manager")
        self.stats = NodeCopyStats()

    def close(self) -> None:
        self.host.close()

    @torch.inference_mode()
    def run(self, orders: list[Order], covered: set[int] | None = None) -> tuple[list[Order], set[int]]:
        """Runs ``orders``; returns those that failed and the device blocks a failed load left
        unwritten. ``covered`` (post orders): the device blocks the forward pass filled."""
        if not orders:
            return [], set()
        start = time.perf_counter()
        saves = [o for o in orders if type(o) is Save and o.to == "host"]
        gathered = dict(zip((o.src for o in saves), self._gather([o.src for o in saves]))) if saves else {}
        loads = {id(o): row for row, o in enumerate(o for o in orders if type(o) is Load and o.frm == "host")}
        staging = torch.empty((len(loads), *self.layout.block_shape), dtype=self.layout.dtype)
        failed: list[Order] = []
        bad_slots: set[int] = set()  # host slots a failed prefetch did not fill
        # host slots a prefetch of this run filled, with the verified block it wrote: the load
        # behind it takes that block instead of reading and checksumming the slot again
        fresh: dict[int, tuple[bytes, torch.Tensor]] = {}
        landed: list[tuple[int, int]] = []  # (staging row, device block)
        for o in orders:
            f = self._one(o, gathered, staging, loads, bad_slots, fresh, covered, landed)
            if f is not None:
                failed.append(o)
                self.stats.failed(f.reason)
                if type(o) is Load and o.frm == "disk":
                    bad_slots.add(o.dst)
                logger.info("node tier: %s failed (%s: %s)", o, f.reason, f.detail)
        self._scatter(staging, landed)
        self.stats.wall_s += time.perf_counter() - start
        unwritten = {o.dst for o in failed if type(o) is Load and o.frm == "host"}
        return failed, unwritten

    def _one(self, o: Order, gathered: dict[int, torch.Tensor], staging: torch.Tensor, loads: dict[int, int],
             bad_slots: set[int], fresh: dict[int, tuple[bytes, torch.Tensor]], covered: set[int] | None,
             landed: list[tuple[int, int]]) -> Failure | None:
        if type(o) is Save:
            if o.to == "host":
                if covered is not None and o.src not in covered:
                    return Failure("not_computed", f"device block {o.src} was not filled by this step")
                f = self.host.write(o.dst, o.key, gathered[o.src])
            else:
                block = self.layout.empty_block()
                f = self._read_host(o.src, o.key, block, bad_slots) or self._disk().write(o.dst, o.key, block)
        elif o.frm == "host":
            row = loads[id(o)]
            just = fresh.get(o.src)
            if just is not None and just[0] == o.key:
                staging[row].copy_(just[1])
                f = None
            else:
                f = self._read_host(o.src, o.key, staging[row], bad_slots)
            if f is None:
                landed.append((row, o.dst))
        else:
            block = self.layout.empty_block()
            f = self._disk().read_into(o.src, o.key, block) or self.host.write(o.dst, o.key, block)
            if f is None:
                fresh[o.dst] = (o.key, block)
        if f is None:
            (self.stats.saves if type(o) is Save else self.stats.loads)[o.to if type(o) is Save else o.frm] += 1
        return f

    def _read_host(self, slot: int, key: bytes, out: torch.Tensor, bad_slots: set[int]) -> Failure | None:
        if slot in bad_slots:
            out.zero_()
            return Failure("prefetch_failed", f"host slot {slot}: its prefetch from disk failed")
        return self.host.read_into(slot, key, out)

    def _disk(self) -> DiskStore:
        if self.disk is None:
            raise NodeStoreError("the manager ordered a disk copy but this layout's node tier has no disk level")
        return self.disk

    def _gather(self, blocks: list[int]) -> list[torch.Tensor]:
        """Device blocks as contiguous CPU blocks [layers, 2, block_size, heads, head_size]."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        # per layer [2, n, ...] -> [n, layers, 2, ...]
        out = torch.stack([c.index_select(1, idx) for c in self.device_caches]).permute(2, 0, 1, 3, 4, 5)
        out = out.to("cpu").contiguous()
        return list(out.unbind(0))

    def _scatter(self, staging: torch.Tensor, landed: list[tuple[int, int]]) -> None:
        if not landed:
            return
        rows = torch.tensor([r for r, _ in landed], dtype=torch.int64)
        dst = torch.tensor([d for _, d in landed], dtype=torch.int64, device=self.device)
        moved = staging.index_select(0, rows).to(self.device)  # [n, layers, 2, ...]
        for layer, cache in enumerate(self.device_caches):
            cache.index_copy_(1, dst, moved[:, layer].transpose(0, 1))


def covered_blocks(batch: Batch, block_size: int) -> set[int]:
    """The device blocks whose every token is in the cache once ``batch``'s forward ran."""
    out: set[int] = set()
    for s in batch.seqs:
        full = (s.start + len(s.token_ids)) // block_size
        out.update(s.block_table[:full])
    return out


def recompute(batch: Batch, unwritten: set[int], block_size: int) -> int:
    """Moves each sequence that would read an ``unwritten`` block as cached context back to
    that block's start, so the forward pass computes it; returns the tokens added."""
    added = 0
    if not unwritten:
        return 0
    for s, req in zip(batch.seqs, batch.reqs, strict=True):
        cached_blocks = -(-s.start // block_size)
        first = next((i for i, b in enumerate(s.block_table[:cached_blocks]) if b in unwritten), None)
        if first is None:
            continue
        new_start = first * block_size
        end = s.start + len(s.token_ids)
        added += s.start - new_start
        s.token_ids, s.start = req.tokens[new_start:end], new_start
    return added
