"""The node tier's disk reads and writes with a deadline (worker/node_disk_io.py): a read that
never returns (a FIFO with a writer that never writes, as a hung mount blocks) fails as
``deadline`` after it, its host slot is never written even when the read completes later, and
reads held by late ones fail at once instead of queueing behind them; a write-down reads its host
slot in order, and one whose file write hangs is reported late, its late commit never served."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers.manager import wait_until
from helpers.node_tier import MODEL, SPEC, node_tier

from kvpool.shared.node_orders import Load, Save
from kvpool.worker.node_copier import NodeCopier
from kvpool.worker.node_disk_io import DiskIO
from kvpool.worker.node_store import StoreLayout

K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
pytestmark = pytest.mark.timeout(60)  # today's blocking read hangs: fail instead


def block(lay: StoreLayout, seed: int) -> torch.Tensor:
    return torch.randn(lay.block_shape, generator=torch.Generator().manual_seed(seed)).to(lay.dtype)


@pytest.fixture
def copier(tmp_path):
    _, info = node_tier(tmp_path, host_blocks=4, disk_blocks=4)
    lay = StoreLayout(SPEC, MODEL)
    caches = [torch.zeros(2, 4, 16, SPEC.num_kv_heads, SPEC.head_size) for _ in range(SPEC.num_layers)]
    c = NodeCopier(caches, info, lay, read_timeout_s=0.3)
    yield c
    c.close()


def stuck(path) -> int:
    """Replaces ``path`` with a FIFO whose only writer (the fd returned) writes nothing yet: a
    read of it blocks until that fd writes or closes."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return os.open(path, os.O_RDWR)


def test_a_read_past_its_deadline_fails_and_its_block_never_lands_even_when_it_completes(copier):
    lay, disk = copier.layout, copier.disk
    b1, b2 = block(lay, 1), block(lay, 2)
    assert disk.write(1, K1, b1) is None and disk.write(2, K2, b2) is None
    whole = disk.path(2).read_bytes()  # slot 2's valid file, served late below
    writer = stuck(disk.path(2))
    try:
        orders = [Load("disk", 1, 1, K1), Load("disk", 2, 2, K2), Load("host", 1, 1, K1), Load("host", 2, 2, K2)]
        failed, late, unwritten = copier.run(orders)
        assert failed == [orders[3]] and late == [orders[1]] and unwritten == {2}
        assert copier.stats.failures == {"deadline": 1, "prefetch_failed": 1}
        assert copier.stats.loads == {"host": 1, "disk": 1}
        assert torch.equal(torch.stack([c[:, 1] for c in copier.device_caches]), b1)  # the one in time landed
        os.write(writer, whole)  # the read completes now, verified, long after its deadline
    finally:
        os.close(writer)
    wait_until(lambda: copier.disk_io.late == 0)  # its thread is free again
    out = lay.empty_block()
    assert copier.host.read_into(2, K2, out).reason == "uncommitted"  # the late block never reached the slot
    assert not torch.any(torch.stack([c[:, 2] for c in copier.device_caches]))


def test_reads_held_by_late_ones_fail_at_once_and_the_pool_recovers(copier):
    lay, disk = copier.layout, copier.disk
    for slot, key in ((1, K1), (2, K2)):
        assert disk.write(slot, key, block(lay, slot)) is None
    reads = DiskIO(disk, 0.2, threads=1)
    writer = stuck(disk.path(1))
    try:
        first = reads.start(1, K1)
        wait_until(first.running)  # blocked in the FIFO
        f, got = reads.wait(first, 1, time.monotonic() + 0.2)
        assert f.reason == "deadline" and got is None and reads.late == 1
        fut = reads.start(2, K2)  # the only thread is blocked: no wait for a second deadline
        assert fut.done() and fut.result()[0].reason == "deadline"
    finally:
        os.close(writer)  # the late read ends (a short read, dropped)
    wait_until(lambda: reads.late == 0)
    f, got = reads.wait(reads.start(2, K2), 2, time.monotonic() + 10.0)
    assert f is None and torch.equal(got, block(lay, 2))
    f, got = reads.wait(reads.start(3, K3), 3, time.monotonic() + 10.0)
    assert f.reason == "missing" and got is None
    reads.close()


def test_a_read_queued_past_its_deadline_never_runs(copier):
    disk = copier.disk
    assert disk.write(2, K2, block(copier.layout, 2)) is None
    reads = DiskIO(disk, 0.2, threads=1)
    writer = stuck(disk.path(1))
    try:
        first = reads.start(1, K1)
        wait_until(first.running)
        queued = reads.start(2, K2)  # behind the blocked one
        assert reads.wait(queued, 2, time.monotonic() + 0.2)[0].reason == "deadline"
        assert queued.cancelled() and reads.late == 0  # it never took a thread
        assert reads.wait(first, 1, time.monotonic())[0].reason == "deadline" and reads.late == 1
    finally:
        os.close(writer)
    wait_until(lambda: reads.late == 0)
    reads.close()


def test_a_write_down_reads_its_host_slot_in_order_and_a_hung_write_is_late(copier, monkeypatch):
    lay, disk, host = copier.layout, copier.disk, copier.host
    b1, b2 = block(lay, 1), block(lay, 2)
    assert host.write(1, K1, b1) is None
    for layer, c in enumerate(copier.device_caches):  # device block 2 holds b2
        c[:, 2] = b2[layer]
    # the write-down of host slot 1, then a save that reuses that slot: the disk gets b1
    orders = [Save("disk", 1, 3, K1), Save("host", 2, 1, K2)]
    assert copier.run(orders) == ([], [], set())
    out = lay.empty_block()
    assert disk.read_into(3, K1, out) is None and torch.equal(out, b1)
    assert copier.stats.saves == {"host": 1, "disk": 1}

    release, write = threading.Event(), disk.write
    monkeypatch.setattr(disk, "write", lambda *a: release.wait(30) and write(*a))  # a disk that hangs
    hung = Save("disk", 1, 4, K2)
    t0 = time.monotonic()
    assert copier.run([hung]) == ([], [hung], set())  # late, not failed: the manager counts it apart
    assert time.monotonic() - t0 < 20 and copier.stats.failures == {"deadline": 1}
    release.set()  # the write commits long after its deadline
    wait_until(lambda: copier.disk_io.late == 0)
    assert disk.read_into(4, K3, out).reason == "wrong_key"  # the slot's next block is never served it
