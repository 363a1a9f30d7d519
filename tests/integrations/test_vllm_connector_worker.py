"""The connector's worker half (kvpool/integrations/vllm/worker.py) on a real host store and a
cache laid out as vLLM's CPU backend lays it: verified loads land in vLLM's blocks, a slot that
does not verify leaves its block untouched and is named to vLLM as a load error, a block the
tier no longer held is one too, and a block computed over a failed load is never saved."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers.manager import wait_until

from kvpool.integrations.vllm.kv_layout import block_view
from kvpool.integrations.vllm.records import LoadJob, NodeStepPlan, SaveJob
from kvpool.integrations.vllm.worker import KvpoolWorker
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_orders import Load, Save
from kvpool.shared.node_tier import NodeTierInfo, host_stride
from kvpool.shared.protocol import KVSpec
from kvpool.worker.node_layout import HEADER
from kvpool.worker.node_store import DiskStore, HostStore, StoreLayout

SPEC = KVSpec(block_size=4, num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
LAYOUT = StoreLayout(SPEC, "vllm:test")
KEYS = hash_blocks(list(range(40)), 4)


def setup(tmp_path):
    caches = [torch.full((8, 2, 4, 16), 7.0) for _ in range(2)]  # vLLM CPU layers [blocks, heads, N, 2D]
    worker = KvpoolWorker(LAYOUT)
    worker.register([block_view(c, "cpu", 4, 2, 8) for c in caches])
    store = HostStore(LAYOUT, 8, tmp_path)
    blocks = [torch.randn(LAYOUT.block_shape) for _ in range(3)]
    for slot, (key, block) in enumerate(zip(KEYS, blocks), start=1):
        assert store.write(slot, key, block) is None
    return worker, store, blocks, NodeTierInfo(LAYOUT.name, str(tmp_path), 8).to_wire()


def flip(store: HostStore, slot: int) -> None:
    with open(store.path, "r+b") as f:
        f.seek(slot * host_stride(LAYOUT.block_bytes) + HEADER.size + 17)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


def block_of(worker: KvpoolWorker, b: int) -> torch.Tensor:
    return torch.stack([v[b] for v in worker.views])


def test_verified_loads_land_and_a_corrupt_or_missing_block_is_a_load_error(tmp_path):
    worker, store, blocks, tier = setup(tmp_path)
    flip(store, 2)
    orders = [Load("host", slot, pos, KEYS[slot - 1]) for pos, slot in ((1, 1), (2, 2), (3, 3))]
    plan = NodeStepPlan(tier, [LoadJob("r", 5, orders, [4, 5, 6, 7], [7], 2)])
    worker.load(plan)
    torch.testing.assert_close(block_of(worker, 4), blocks[0], rtol=0, atol=0)
    torch.testing.assert_close(block_of(worker, 6), blocks[2], rtol=0, atol=0)
    assert block_of(worker, 5).eq(7.0).all()  # never written (not even zeroed): vLLM recomputes it
    assert worker.take_errors() == {5, 7} and worker.take_errors() == set()
    assert worker.failed_from == {"r": 3}  # the request's block index of block 5
    report = worker.take_report()
    assert report.reports == [{"batch": 5, "failed": [orders[1].to_wire()]}]
    assert report.counts["loaded_blocks"] == 2 and report.counts["failed_mismatch"] == 1

    # after the forward: a block of r at or after its failed load is not saved; r's block 2 is
    key_ok, key_bad = KEYS[5], KEYS[6]
    save = SaveJob(6, [Save("host", 4, 5, key_ok), Save("host", 6, 6, key_bad)], {key_ok: ("r", 2), key_bad: ("r", 4)})
    worker.save(NodeStepPlan(tier, save=save))
    out = LAYOUT.empty_block()
    assert store.read_into(5, key_ok, out) is None
    torch.testing.assert_close(out, blocks[0], rtol=0, atol=0)
    assert store.read_into(6, key_bad, out) is not None  # nothing was written there
    assert worker.take_report().reports == [{"batch": 6, "failed": [save.orders[1].to_wire()]}]


def test_without_a_tier_every_load_is_an_error_and_nothing_is_saved(tmp_path):
    worker, _, _, _ = setup(tmp_path)
    worker.load(NodeStepPlan(None, [LoadJob("r", None, [], [2, 3], [2, 3], 0)]))
    assert worker.take_errors() == {2, 3}
    assert worker.take_report().reports == []  # no batch: nothing to report
    other = NodeTierInfo("00" * 8, str(tmp_path), 8).to_wire()  # another layout's tier: never opened
    save = SaveJob(9, [Save("host", 2, 1, KEYS[0])], {KEYS[0]: ("r", 0)})
    worker.save(NodeStepPlan(other, save=save))
    assert worker.take_report().reports == [{"batch": 9, "failed": [save.orders[0].to_wire()]}]


@pytest.mark.timeout(60)  # a disk read without a deadline hangs here: fail instead
def test_a_disk_read_that_never_returns_is_a_load_error_after_the_deadline(tmp_path):
    """The twin of the worker's deadline (worker/node_disk_io.py): a disk slot whose read blocks
    for ever (a FIFO whose writer writes nothing, as a hung mount) fails after ``read_timeout_s``;
    its host slot and vLLM's block are left alone and vLLM recomputes from there, while the other
    prefetch of the same batch lands."""
    worker, store, blocks, _ = setup(tmp_path)
    worker = KvpoolWorker(LAYOUT, read_timeout_s=0.3)
    worker.register([block_view(torch.full((8, 2, 4, 16), 7.0), "cpu", 4, 2, 8) for _ in range(2)])
    disk_dir = tmp_path / "disk"
    disk = DiskStore(LAYOUT, disk_dir, 8 * (HEADER.size + LAYOUT.block_bytes))
    assert disk.write(1, KEYS[0], blocks[0]) is None and disk.write(2, KEYS[1], blocks[1]) is None
    disk.path(2).unlink()
    os.mkfifo(disk.path(2))
    writer = os.open(disk.path(2), os.O_RDWR)  # the read of slot 2 blocks until this writes or closes
    try:
        tier = NodeTierInfo(LAYOUT.name, str(tmp_path), 8, str(disk_dir), 8 * (HEADER.size + LAYOUT.block_bytes),
                            8).to_wire()
        orders = [Load("disk", 1, 4, KEYS[0]), Load("disk", 2, 5, KEYS[1]),
                  Load("host", 4, 1, KEYS[0]), Load("host", 5, 2, KEYS[1])]
        worker.load(NodeStepPlan(tier, [LoadJob("r", 3, orders, [2, 3], [], 0)]))
        torch.testing.assert_close(block_of(worker, 2), blocks[0], rtol=0, atol=0)
        assert block_of(worker, 3).eq(7.0).all()  # never written: vLLM recomputes it
        assert worker.take_errors() == {3}
        report = worker.take_report()
        # the late read apart (the manager counts a deadline miss), the host load behind it failed
        assert report.reports == [{"batch": 3, "failed": [orders[3].to_wire()], "late": [orders[1].to_wire()]}]
        assert report.counts["failed_deadline"] == 1 and report.counts["failed_prefetch_failed"] == 1
        assert worker.disk_io.late == 1
    finally:
        os.close(writer)  # the late read returns (short) and frees its thread
    out = LAYOUT.empty_block()
    assert store.read_into(5, KEYS[1], out) is not None  # the late read never reached host slot 5
    worker.close()


@pytest.mark.timeout(60)
def test_a_write_down_that_hangs_is_reported_late_and_the_save_job_returns(tmp_path, monkeypatch):
    """The twin of the worker's write-down deadline: a save job's write-down (host slot -> disk)
    whose file write hangs is reported ``late`` after ``read_timeout_s``; the host save of the
    same job lands, and the late write's commit names its own key."""
    _, store, _, _ = setup(tmp_path)
    worker = KvpoolWorker(LAYOUT, read_timeout_s=0.3)
    worker.register([block_view(torch.full((8, 2, 4, 16), 7.0), "cpu", 4, 2, 8) for _ in range(2)])
    disk_dir = tmp_path / "disk"
    budget = 8 * (HEADER.size + LAYOUT.block_bytes)
    tier = NodeTierInfo(LAYOUT.name, str(tmp_path), 8, str(disk_dir), budget, 8).to_wire()
    worker.load(NodeStepPlan(tier, [LoadJob("r", None, [], [], [], 0)]))  # opens the stores, loads nothing
    assert worker.disk is not None
    release, write = threading.Event(), worker.disk.write
    monkeypatch.setattr(worker.disk, "write", lambda *a: release.wait(30) and write(*a))  # a disk that hangs
    down, up = Save("disk", 1, 2, KEYS[0]), Save("host", 3, 7, KEYS[7])
    save = SaveJob(4, [down, up], {KEYS[7]: ("r", 0)})
    t0 = time.monotonic()
    worker.save(NodeStepPlan(tier, save=save))
    assert time.monotonic() - t0 < 20
    assert worker.take_report().reports == [{"batch": 4, "late": [down.to_wire()]}]
    out = LAYOUT.empty_block()
    assert store.read_into(7, KEYS[7], out) is None  # the host save of the same job landed
    release.set()
    wait_until(lambda: worker.disk_io.late == 0, what="the late write to end")
    assert DiskStore(LAYOUT, disk_dir, budget).read_into(2, KEYS[1], out).reason == "wrong_key"
    worker.close()
