"""The connector's worker half: runs a step's node-tier orders between vLLM's KV blocks and the
node tier's stores (worker/node_store.py), verified, and reports what did not land.

Loads run before the forward pass (vLLM's ``start_load_kv`` of a step with synchronous loads),
in the order the manager gave: a disk prefetch is read (verified) into its host slot, a host load
is read (verified) into a staging block and written into vLLM's block only once whole and
verified, a write-down copies a host slot (verified) to disk. The step's disk reads start first,
on worker/node_disk_io.py's threads, and are waited on with one deadline (``read_timeout_s``): a
read that misses it fails like one that does not verify. A write-down's host slot is read in
order and its file written on the same threads, waited on at the end of its batch with the same
timeout: one that misses it is reported late. A load that does not verify, and a
block the tier no longer held, is a *load error*: vLLM's block is left as it is and named to vLLM
(``get_block_ids_with_load_errors``), which recomputes the request from that block (with
``kv_load_failure_policy: "recompute"``). Nothing unverified is ever written into vLLM's cache.

Saves run after the forward pass (``wait_for_save``): vLLM's blocks are gathered once and
written into their host slots. A block at or after a failed load of its own request in this step
is not saved (its K/V were computed over context that is not there) and is reported failed, as
is every order of a store that could not be opened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvpool.integrations.vllm.kv_layout import gather, scatter
from kvpool.integrations.vllm.records import LoadJob, NodeStepPlan, NodeStepReport, SaveJob
from kvpool.shared.node_orders import Load, NodeReport, Order, Save
from kvpool.shared.node_tier import READ_TIMEOUT_S, NodeTierInfo
from kvpool.worker.node_disk_io import DiskIO, Pending
from kvpool.worker.node_store import DiskStore, Failure, HostStore, NodeStoreError, StoreLayout

logger = logging.getLogger(__name__)


class KvpoolWorker:
    def __init__(self, layout: StoreLayout, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.layout = layout
        self.read_timeout_s = read_timeout_s
        self.disk_io: DiskIO | None = None  # the disk level's reads and writes with a deadline
        self.views: list[torch.Tensor] = []  # per layer [num_blocks, 2, N, H, D] views of vLLM's cache
        self.info: NodeTierInfo | None = None
        self.host: HostStore | None = None
        self.disk: DiskStore | None = None
        self.errors: set[int] = set()  # vLLM blocks whose load failed, until vLLM asks
        self.report = NodeStepReport()
        self.failed_from: dict[str, int] = {}  # this step: request -> its first block index not loaded
        self.late: set[Order] = set()  # failed orders of the batch being run that missed the disk deadline

    def register(self, views: Sequence[torch.Tensor]) -> None:
        self.views = list(views)

    def _open(self, tier: dict | None) -> bool:
        """The stores of the tier the plan names (reopened when the manager's answer changed)."""
        if tier is None:
            return False
        info = NodeTierInfo.from_wire(tier)
        if info == self.info:
            return self.host is not None
        self.close()
        self.info = info
        if info.layout != self.layout.name:
            logger.error("kvpool connector: the manager's tier is layout %s, this server's blocks are %s",
                         info.layout, self.layout.name)
            return False
        try:
            self.host = HostStore(self.layout, info.host_slots, info.host_dir)
            if info.disk_dir is not None:
                self.disk = DiskStore(self.layout, info.disk_dir, info.disk_bytes)
                self.disk_io = DiskIO(self.disk, self.read_timeout_s)
        except (NodeStoreError, OSError) as e:
            logger.error("kvpool connector: cannot open the node tier's stores: %s", e)
            self.close()
            self.info = info
            return False
        return True

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        if self.disk_io is not None:
            self.disk_io.close()
        self.host = self.disk = self.disk_io = None
        self.info = None

    # -- loads -------------------------------------------------------------------------------

    def load(self, plan: NodeStepPlan) -> None:
        self.failed_from = {}
        if not plan.loads:
            return
        usable = self._open(plan.tier)
        for job in plan.loads:
            failed = self._guarded(self._run_load, job) if usable and job.batch is not None else list(job.orders)
            bad = {job.blocks[o.dst - 1] for o in failed if type(o) is Load and o.frm == "host"}
            if not usable or job.batch is None:
                bad = set(job.blocks)
            bad |= set(job.missing)
            if bad:
                self.errors |= bad
                first = min(i for i, b in enumerate(job.blocks) if b in bad)
                self.failed_from[job.req_id] = job.first_index + first
                self._count("load_errors", len(bad))
            if job.batch is not None:
                self._reported(job.batch, failed)

    def _run_load(self, job: LoadJob) -> list[Order]:
        host, failed, bad_slots, writes = self.host, [], set(), []
        if host is None:
            return list(job.orders)
        staged: list[tuple[int, torch.Tensor]] = []
        # every disk read starts now (the batch holds the slots it reads: nothing in it writes them)
        reads = {i: self.disk_io.start(o.src, o.key) for i, o in enumerate(job.orders)
                 if type(o) is Load and o.frm == "disk" and self.disk_io is not None}
        deadline = time.monotonic() + self.read_timeout_s
        for i, o in enumerate(job.orders):
            if type(o) is Load and o.frm == "host":
                block = self.layout.empty_block()
                f = self._read_host(o.src, o.key, block, bad_slots)
                if f is None:
                    staged.append((job.blocks[o.dst - 1], block))
            elif type(o) is Load:  # disk -> host: a prefetch
                f = self._prefetched(o, reads.get(i), deadline)
                if f is not None:
                    bad_slots.add(o.dst)
            else:
                f = self._write_down(o, bad_slots, writes)
            if f is not None:
                failed.append(o)
                self._failure(o, f)
        failed += self._written(writes)
        if staged:
            scatter(self.views, [b for b, _ in staged], [t for _, t in staged])
            self._count("loaded_blocks", len(staged))
        return failed

    # -- saves -------------------------------------------------------------------------------

    def save(self, plan: NodeStepPlan) -> None:
        job = plan.save
        if job is None:
            return
        if not self._open(plan.tier):
            self._reported(job.batch, list(job.orders))
            return
        self._reported(job.batch, self._guarded(self._run_save, job))

    def _guarded(self, run, job: LoadJob | SaveJob) -> list[Order]:
        """``run(job)``; every order failed if it raised (a copy must never stop vLLM)."""
        try:
            return run(job)
        except Exception:
            logger.exception("kvpool connector: node-tier batch %s failed as a whole", job.batch)
            self._count("failed_batches", 1)
            return list(job.orders)

    def _run_save(self, job: SaveJob) -> list[Order]:
        host, failed, bad_slots, writes = self.host, [], set(), []
        if host is None:
            return list(job.orders)
        saves = [o for o in job.orders if type(o) is Save and o.to == "host" and not self._after_failed_load(job, o)]
        data = dict(zip((o.src for o in saves), gather(self.views, [o.src for o in saves]))) if saves else {}
        for o in job.orders:
            if type(o) is Save and o.to == "host":
                block = data.get(o.src)
                f = (host.write(o.dst, o.key, block) if block is not None else
                     Failure("not_computed", f"vLLM block {o.src} was computed over a block that did not load"))
                if f is not None:
                    bad_slots.add(o.dst)
            else:
                f = self._write_down(o, bad_slots, writes)
            if f is not None:
                failed.append(o)
                self._failure(o, f)
        failed += self._written(writes)
        self._count("saved_blocks", len(data))
        return failed

    def _after_failed_load(self, job: SaveJob, o: Save) -> bool:
        req_id, index = job.owners.get(o.key, ("", 0))
        first = self.failed_from.get(req_id)
        return first is not None and index >= first

    # -- shared ------------------------------------------------------------------------------

    def _write_down(self, o: Order, bad_slots: set[int], writes: list[tuple[Order, Pending]]) -> Failure | None:
        """host slot -> disk slot: the host bytes read and verified now, in order; the file
        written on the disk I/O threads (``writes``; ``_written`` waits for them)."""
        if self.disk is None or self.disk_io is None:
            return Failure("io_error", "the manager ordered a disk copy, but its tier has no disk level here")
        block = self.layout.empty_block()
        f = self._read_host(o.src, o.key, block, bad_slots)
        if f is None:
            writes.append((o, self.disk_io.start_write(o.dst, o.key, block)))
        return f

    def _written(self, writes: list[tuple[Order, Pending]]) -> list[Order]:
        """The write-downs of a batch that failed or missed the deadline (counted)."""
        failed: list[Order] = []
        if writes:
            deadline = time.monotonic() + self.read_timeout_s
            for o, pending in writes:
                f = self.disk_io.wait(pending, o.dst, deadline)[0]  # type: ignore[union-attr]
                if f is not None:
                    failed.append(o)
                    self._failure(o, f)
        return failed

    def _prefetched(self, o: Load, read: Pending | None, deadline: float) -> Failure | None:
        """disk slot -> host slot: the read's verified block, if it came by ``deadline``."""
        if read is None or self.disk_io is None:
            return Failure("missing", "the manager ordered a disk read, but its tier has no disk level here")
        f, block = self.disk_io.wait(read, o.src, deadline)
        return f or self.host.write(o.dst, o.key, block)  # type: ignore[union-attr]

    def _read_host(self, slot: int, key: bytes, out: torch.Tensor, bad_slots: set[int]) -> Failure | None:
        if slot in bad_slots:
            return Failure("prefetch_failed", f"host slot {slot} was not filled in this batch")
        return self.host.read_into(slot, key, out)  # type: ignore[union-attr]

    def _failure(self, o: Order, f: Failure) -> None:
        if f.reason == "deadline":  # reported apart: the manager counts a deadline miss
            self.late.add(o)
        self._count(f"failed_{f.reason}", 1)
        logger.info("kvpool connector: %s failed (%s: %s)", o, f.reason, f.detail)

    def _reported(self, batch: int, failed: list[Order]) -> None:
        """``{batch, failed?, late?}`` (shared/node_orders.py ``NodeReport``) for the manager."""
        late, self.late = self.late, set()
        rep = NodeReport(batch, tuple(o for o in failed if o not in late), tuple(o for o in failed if o in late))
        self.report.reports.append(rep.to_wire())

    def _count(self, name: str, n: int) -> None:
        self.report.counts[name] = self.report.counts.get(name, 0) + n

    def take_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def take_report(self) -> NodeStepReport | None:
        report, self.report = self.report, NodeStepReport()
        return report if report.reports or report.counts else None
