"""The worker's side of the node tier: runs a step's node-tier orders between its KV tensors
and the node's stores, verifying every block it reads, and recomputes what did not verify.

The manager hands the orders out (manager/core/pool_node.py) and keeps the bookkeeping; the
bytes live in the stores every worker of the layout maps (worker/node_store.py). A step's orders
come in two lists (shared/node_orders.py ``NodeOrders``), run in the order given:

  * ``pre``, before the forward pass: saves of the private host tier's blocks it is handing out
    again (private host -> node host), saves of device blocks being reused (device -> host),
    write-downs (host -> disk: the host slot is read verified first), prefetches (disk -> host,
    verified) and loads (host -> device, verified). Device blocks are read before any is
    written: every save's block is gathered first (a save never reads a block a load of the
    same step writes: the manager saves a block before it is handed out again, and never saves
    a block handed out in the same step), and the loads are scattered last: after the host
    tier's own saves, which read device blocks too and overwrite private host blocks these
    orders read first (worker/runner.py, ``land_loads``).
  * ``post``, after it: saves of the blocks the forward pass filled. A save of a block the
    forward did not fill (its sequence left the batch: finished, aborted, preempted) is not run
    and reported failed, so no other tokens are ever stored under its hash.

The disk reads of a run (its prefetches) start together when it starts, on a few threads of
their own (worker/node_disk_io.py), and run while the orders before them do; each is waited on
with the run's one deadline (``read_timeout_s``, the worker's ``node_tier_read_timeout``). A
read that misses it fails as a read that does not verify, and its block is never used: the host
slot it was to fill is written here, by the step's thread, only with a block that arrived in time.
A write-down reads its host slot here, in order (a later order of the run may overwrite that
slot), and hands the file write to the same threads; the run waits for its writes at its end,
at most ``read_timeout_s`` again: a write that misses it is reported late and its hash dropped.

Every order that does not land (a read that does not verify: a flipped byte, a torn or missing
slot, a block of another layout or key; a disk read or write past its deadline; a write to a
full disk) is reported to the manager in the step's ``NodeReport`` (a missed deadline in its
``late`` list, the rest in ``failed``), which drops the hash from that level.
A load into the device that did not verify leaves its block zeroed (node_store.py), never
served: ``recompute`` moves each sequence that reads such a block back to its start, so this
very forward pass computes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvpool.shared.node_orders import Load, Order, Save
from kvpool.shared.node_tier import READ_TIMEOUT_S, NodeTierInfo
from kvpool.shared.protocol import KVSpec
from kvpool.worker.node_disk_io import DiskIO, Pending
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


@dataclass
class _Run:
    """One ``run``'s working state."""

    gathered: dict[tuple[str, int], torch.Tensor]  # the blocks saves to host read, by (source, block)
    staging: torch.Tensor  # [loads, layers, 2, ...]: the host -> device loads' blocks
    loads: dict[int, int]  # id(host -> device load) -> its staging row
    reads: dict[int, Pending]  # id(disk -> host load) -> its disk read, started with the run
    deadline: float  # time.monotonic() by which every disk read is in, or missed
    covered: set[int] | None
    bad_slots: set[int] = field(default_factory=set)  # host slots a failed prefetch did not fill
    # host slots a prefetch of this run filled, with the verified block it wrote: the load
    # behind it takes that block instead of reading and checksumming the slot again
    fresh: dict[int, tuple[bytes, torch.Tensor]] = field(default_factory=dict)
    landed: list[tuple[int, int]] = field(default_factory=list)  # (staging row, device block)
    writes: list[tuple[Save, Pending]] = field(default_factory=list)  # write-downs under way, in order


class NodeCopier:
    """One layout's stores, mapped by this worker, and the copies of its steps."""

    def __init__(self, device_caches: list[torch.Tensor], info: NodeTierInfo, layout: StoreLayout,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        # a pool's tier names a store per rank; a tier an engine joined rank by rank is one store
        expected = info.stores[layout.rank] if layout.rank < len(info.stores) else info.layout
        if layout.name != expected:
            raise NodeStoreError(f"the manager's node tier is for layout {info.layout} ({info.world} stores), this "
                                 f"worker's blocks are layout {layout.name} (rank {layout.rank} of {layout.world}): "
                                 "a different model, dtype, block shape or tensor-parallel size")
        self.info, self.layout, self.device_caches = info, layout, device_caches
        self.device = device_caches[0].device
        self.host = HostStore(layout, info.host_slots, info.host_dir)
        self.disk: DiskStore | None = None
        self.disk_io: DiskIO | None = None
        if info.disk_dir is not None:
            # no fsync: a file the rename committed but a power loss tore fails its checksum on
            # read and is recomputed, so an fsync per block (milliseconds on the step's critical
            # path) buys nothing a cache needs
            self.disk = DiskStore(layout, info.disk_dir, info.disk_bytes, fsync=False)
            if self.disk.num_slots != info.disk_slots:
                raise NodeStoreError(f"disk level: {self.disk.num_slots} slots here, {info.disk_slots} at the manager")
            self.disk_io = DiskIO(self.disk, read_timeout_s)
        self.stats = NodeCopyStats()
        self._staged: tuple[torch.Tensor | None, list[tuple[int, int]]] = (None, [])  # loads not yet landed

    def close(self) -> None:
        if self.disk_io is not None:
            self.disk_io.close()
        self.host.close()

    def count_recomputed(self, num_tokens: int) -> None:
        """``num_tokens`` were computed again because a load of theirs did not verify."""
        self.stats.recomputed_tokens += num_tokens

    @torch.inference_mode()
    def run(self, orders: list[Order], covered: set[int] | None = None, private: list[torch.Tensor] | None = None,
            defer_loads: bool = False) -> tuple[list[Order], list[Order], set[int]]:
        """Runs ``orders``; returns those that failed, the disk reads and writes that missed the
        deadline (``late``: the manager counts them apart) and the device blocks a failed load
        left unwritten. ``covered`` (post orders): the device blocks the forward pass filled.
        ``private``: the private host tier's tensors, which saves of ``source="private"`` read.
        ``defer_loads``: the loads' device writes wait for ``land_loads`` (the host tier's saves
        read those device blocks in between)."""
        if not orders:
            return [], [], set()
        start = time.perf_counter()
        # the disk reads first, all at once: the manager holds every disk slot a batch reads, so
        # no order of it writes one (worker/node_disk_io.py)
        prefetches = [o for o in orders if type(o) is Load and o.frm == "disk"]
        reads = {id(o): self._io().start(o.src, o.key) for o in prefetches}
        deadline = time.monotonic() + (self.disk_io.timeout_s if self.disk_io is not None else 0.0)
        saves = [o for o in orders if type(o) is Save and o.to == "host"]
        loads = {id(o): row for row, o in enumerate(o for o in orders if type(o) is Load and o.frm == "host")}
        r = _Run(self._gather_saves(saves, private),
                 torch.empty((len(loads), *self.layout.block_shape), dtype=self.layout.dtype), loads, reads, deadline,
                 covered)
        failed: list[Order] = []
        late: list[Order] = []

        def outcome(o: Order, f: Failure | None) -> None:
            if f is None:
                (self.stats.saves if type(o) is Save else self.stats.loads)[o.to if type(o) is Save else o.frm] += 1
                return
            (late if f.reason == "deadline" else failed).append(o)
            self.stats.failed(f.reason)
            if type(o) is Load and o.frm == "disk":
                r.bad_slots.add(o.dst)
            logger.info("node tier: %s failed (%s: %s)", o, f.reason, f.detail)

        for o in orders:
            if type(o) is Save and o.to == "disk":  # a failed host read now, or its file write below
                f = self._start_write_down(o, r)
                if f is None:
                    continue
            else:
                f = self._one(o, r)
            outcome(o, f)
        if r.writes:  # the write-downs' files, written while the orders after them ran
            write_deadline = time.monotonic() + self._io().timeout_s
            for o, pending in r.writes:
                outcome(o, self._io().wait(pending, o.dst, write_deadline)[0])
        self._staged = (r.staging, r.landed)
        if not defer_loads:
            self.land_loads()
        self.stats.wall_s += time.perf_counter() - start
        return failed, late, unwritten_blocks(failed)

    def land_loads(self) -> None:
        """The device writes of the last ``run``'s loads that verified."""
        staging, landed = self._staged
        self._staged = (None, [])
        if landed:
            start = time.perf_counter()
            self._scatter(staging, landed)  # type: ignore[arg-type]
            self.stats.wall_s += time.perf_counter() - start

    def _gather_saves(self, saves: list[Save], private: list[torch.Tensor] | None) -> dict[tuple[str, int], torch.Tensor]:
        """The blocks ``saves`` read, by (source, block): device blocks, and the private host
        tier's blocks for saves of ``source="private"``."""
        out: dict[tuple[str, int], torch.Tensor] = {}
        for source, caches in (("device", self.device_caches), ("private", private)):
            blocks = [o.src for o in saves if o.source == source]
            if not blocks:
                continue
            if caches is None:
                raise NodeStoreError("the manager ordered a save from the private host tier but this worker has none")
            out.update(zip(((source, b) for b in blocks), self._gather(blocks, caches)))
        return out

    def _start_write_down(self, o: Save, r: _Run) -> Failure | None:
        """host slot -> disk slot: the host slot read (verified) now, in order; its file written
        on the disk I/O threads (``r.writes``, which ``run`` waits for at its end)."""
        block = self.layout.empty_block()
        f = self._read_host(o.src, o.key, block, r.bad_slots)
        if f is None:
            r.writes.append((o, self._io().start_write(o.dst, o.key, block)))
        return f

    def _one(self, o: Order, r: _Run) -> Failure | None:
        """Runs ``o`` (a save to host, or a load): its failure, or None."""
        if type(o) is Save:
            if r.covered is not None and o.src not in r.covered:
                return Failure("not_computed", f"device block {o.src} was not filled by this step")
            f = self.host.write(o.dst, o.key, r.gathered[(o.source, o.src)])
        elif o.frm == "host":
            row = r.loads[id(o)]
            just = r.fresh.get(o.src)
            if just is not None and just[0] == o.key:
                r.staging[row].copy_(just[1])
                f = None
            else:
                f = self._read_host(o.src, o.key, r.staging[row], r.bad_slots)
            if f is None:
                r.landed.append((row, o.dst))
        else:  # the block its read brought, if in time; the host slot is written here, never by the read
            f, block = self._io().wait(r.reads[id(o)], o.src, r.deadline)
            f = f or self.host.write(o.dst, o.key, block)  # type: ignore[arg-type]
            if f is None:
                r.fresh[o.dst] = (o.key, block)  # type: ignore[assignment]
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

    def _io(self) -> DiskIO:
        self._disk()
        return self.disk_io  # type: ignore[return-value]

    def _gather(self, blocks: list[int], caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Blocks of ``caches`` (the device's, or the private host tier's) as contiguous CPU
        blocks [layers, 2, block_size, heads, head_size]."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0].device)
        # per layer [2, n, ...] -> [n, layers, 2, ...]
        out = torch.stack([c.index_select(1, idx) for c in caches]).permute(2, 0, 1, 3, 4, 5)
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


def map_stores(caches: list[torch.Tensor], info: NodeTierInfo | None, spec: KVSpec, model: str, rank: int = 0,
               world: int = 1, read_timeout_s: float = READ_TIMEOUT_S) -> NodeCopier | None:
    """Rank ``rank`` of ``world``'s stores of the node tier register's reply named (``info``;
    None: none), mapped over ``caches``; a NodeStoreError says what does not match."""
    if info is None:
        return None
    return NodeCopier(caches, info, StoreLayout(spec, model, rank, world), read_timeout_s)


def unwritten_blocks(failed: list[Order]) -> set[int]:
    """The device blocks the failed host -> device loads among ``failed`` left unwritten."""
    return {o.dst for o in failed if type(o) is Load and o.frm == "host"}


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
        s.start_at(new_start, req.tokens[new_start:end])
    return added
