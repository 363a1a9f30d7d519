"""The node store's bytes (worker/node_store.py): round trips, and every restore fault a verify
failure with the buffer zeroed, never served: a flipped byte, a truncated file, a removed file,
a full disk, a writer SIGKILLed mid-save; two processes sharing the host level."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvpool.manager.core.node_tier import NodeTier
from kvpool.shared.node_orders import Save
from kvpool.shared.protocol import KVSpec
from kvpool.worker.node_layout import HEADER
from kvpool.worker.node_store import DiskStore, HostStore, NodeStoreError, StoreLayout, disk_slots

TINY = KVSpec(16, 2, 2, 16, "float32")  # the tiny preset's shard, fp32: 8 KiB a block
K1, K2 = b"\x01" * 32, b"\x02" * 32


def layout(spec: KVSpec = TINY, model: str = "tiny@seed0", **kw) -> StoreLayout:
    return StoreLayout(spec, model, **kw)


def block(lay: StoreLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lay.block_shape, generator=g).to(lay.dtype)


@pytest.fixture
def host(tmp_path):
    store = HostStore(layout(), 4, tmp_path)
    yield store
    store.close()


@pytest.fixture
def disk(tmp_path):
    lay = layout()
    return DiskStore(lay, tmp_path / "disk", 3 * (HEADER.size + lay.block_bytes))


def read(store, slot: int, key: bytes):
    out = torch.full(store.layout.block_shape, 7.0, dtype=store.layout.dtype)
    return store.read_into(slot, key, out), out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_both_levels_round_trip_a_block_and_refuse_other_keys(tmp_path, dtype):
    lay = layout(KVSpec(16, 2, 2, 16, dtype))
    stores = [HostStore(lay, 3, tmp_path), DiskStore(lay, tmp_path / "d", 10 * lay.block_bytes)]
    b = block(lay, 1)
    for store in stores:
        assert store.write(1, K1, b) is None
        failure, out = read(store, 1, K1)
        assert failure is None and torch.equal(out, b)
        failure, out = read(store, 1, K2)
        assert failure.reason == "wrong_key" and not out.any()  # zeroed: never the other block
        assert read(store, 2, K1)[0].reason in ("uncommitted", "missing")
    stores[0].close()


def test_a_flipped_byte_fails_the_checksum_on_both_levels(host, disk):
    b = block(host.layout, 2)
    host.write(1, K1, b)
    host._mm[host.stride + HEADER.size + 100] ^= 0x01  # one bit of K/V in the shared segment
    failure, out = read(host, 1, K1)
    assert failure.reason == "mismatch" and not out.any()
    disk.write(1, K1, b)
    raw = bytearray(disk.path(1).read_bytes())
    raw[HEADER.size + 4000] ^= 0x80
    disk.path(1).write_bytes(bytes(raw))
    failure, out = read(disk, 1, K1)
    assert failure.reason == "mismatch" and not out.any()


def test_a_truncated_or_removed_file_is_a_failure(disk):
    b = block(disk.layout, 3)
    disk.write(1, K1, b)
    raw = disk.path(1).read_bytes()
    disk.path(1).write_bytes(raw[:-1])
    assert read(disk, 1, K1)[0].reason == "short_read"
    disk.path(1).write_bytes(raw[: HEADER.size - 1])
    assert read(disk, 1, K1)[0].reason == "short_read"
    disk.path(1).write_bytes(raw + b"x")
    assert read(disk, 1, K1)[0].reason == "short_read"
    disk.path(1).write_bytes(raw)
    assert read(disk, 1, K1)[0] is None
    disk.remove(1)
    failure, out = read(disk, 1, K1)
    assert failure.reason == "missing" and not out.any()


def test_a_full_disk_is_a_failure_and_keeps_the_slots_earlier_block(disk, tmp_path):
    assert disk.num_slots == 4 == disk_slots(disk.layout, 3 * (HEADER.size + disk.layout.block_bytes))
    b = block(disk.layout, 4)
    assert disk.write(4, K1, b).reason == "full"  # beyond the byte budget
    assert disk.write(1, K1, b) is None
    # the file system itself full: a writer under a file-size limit gets EFBIG (SIGXFSZ ignored)
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from kvpool.shared.protocol import KVSpec
        from kvpool.worker.node_store import DiskStore, StoreLayout
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        store = DiskStore(StoreLayout(KVSpec(16, 2, 2, 16, "float32"), "tiny@seed0"), {str(tmp_path / "disk")!r}, {3 * (HEADER.size + disk.layout.block_bytes)})
        f = store.write(1, {K2!r}, torch.zeros(store.layout.block_shape))
        print(f.reason if f else "ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "full", out.stderr
    failure, got = read(disk, 1, K1)
    assert failure is None and torch.equal(got, b)  # the earlier block, whole
    assert [p.name for p in disk.dir.iterdir()] == [disk.path(1).name]  # no temporary left behind


BIG = KVSpec(64, 16, 8, 128, "float32")  # 8 MiB a block: a save takes long enough to be cut

WRITER = """
import sys, torch
from kvpool.shared.protocol import KVSpec
from kvpool.worker.node_store import DiskStore, HostStore, StoreLayout
lay = StoreLayout(KVSpec(64, 16, 8, 128, "float32"), "big")
kind, where = sys.argv[1], sys.argv[2]
store = HostStore(lay, 2, where) if kind == "host" else DiskStore(lay, where, 4 * lay.block_bytes, fsync=False)
blocks = [torch.full(lay.block_shape, float(i + 1)) for i in range(2)]
print("ready", flush=True)
i = 0
while True:
    store.write(1, bytes([i % 2 + 1]) * 32, blocks[i % 2])
    if i == 0:
        print("saved", flush=True)
    i += 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_writer_killed_mid_save_leaves_nothing_loadable_as_whole(tmp_path, kind):
    """A real writer process saving two blocks in turn into one slot, SIGKILLed at several
    moments: afterwards each key either reads back its own block exactly or fails; the slot
    never serves a mix."""
    lay = StoreLayout(BIG, "big")
    where = str(tmp_path)
    outcomes = set()
    # the last kill comes once a first save is whole, however slowly a loaded machine runs the writer
    for delay in (0.0, 0.011, 0.05, None):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, where], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        if delay is None:
            assert proc.stdout.readline().strip() == "saved"
        else:
            time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        store = HostStore(lay, 2, where) if kind == "host" else DiskStore(lay, where, 4 * lay.block_bytes)
        for i, key in enumerate((K1, K2)):
            failure, out = read(store, 1, key)
            if failure is None:
                assert torch.equal(out, torch.full(lay.block_shape, float(i + 1))), "a mixed block was served"
            else:
                assert failure.reason in ("wrong_key", "uncommitted", "missing") and not out.any()
            outcomes.add(failure.reason if failure else "ok")
        if kind == "host":
            store.close()
        else:
            store.remove_temps()
    assert "ok" in outcomes or "uncommitted" in outcomes  # a kill landed between or within saves


def test_two_processes_share_the_host_level(tmp_path):
    lay = layout()
    mine = HostStore(lay, 4, tmp_path)
    code = textwrap.dedent(f"""
        import torch, xxhash
        from kvpool.shared.protocol import KVSpec
        from kvpool.worker.node_store import HostStore, StoreLayout
        lay = StoreLayout(KVSpec(16, 2, 2, 16, "float32"), "tiny@seed0")
        store = HostStore(lay, 4, {str(tmp_path)!r})
        store.write(2, {K2!r}, torch.arange(lay.block_bytes // 4, dtype=torch.float32).reshape(lay.block_shape))
        out = lay.empty_block()
        f = store.read_into(1, {K1!r}, out)
        print(f.reason if f else xxhash.xxh3_64_hexdigest(out.numpy().tobytes()))
    """)
    b = block(lay, 5)
    mine.write(1, K1, b)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    import xxhash

    assert out.stdout.strip() == xxhash.xxh3_64_hexdigest(b.numpy().tobytes()), out.stderr  # it read mine
    failure, got = read(mine, 2, K2)  # and I read its block, through my own mapping
    assert failure is None and torch.equal(got, torch.arange(lay.block_bytes // 4, dtype=torch.float32).reshape(lay.block_shape))
    mine.close()


def test_layouts_never_share_a_store(tmp_path):
    a, b = layout(), layout(model="tiny-finetune")
    assert a.name != b.name and a.name != layout(rank=1, world=2).name
    assert a.name == layout(KVSpec(16, 2, 2, 16, "float32", max_model_len=99)).name  # not a layout field
    da, db = DiskStore(a, tmp_path, 1 << 20), DiskStore(b, tmp_path, 1 << 20)
    assert da.dir != db.dir
    da.write(1, K1, block(a, 6))
    db.path(1).write_bytes(da.path(1).read_bytes())  # a file of the other layout under this one's name
    assert read(db, 1, K1)[0].reason == "wrong_layout"
    ha = HostStore(a, 4, tmp_path)
    with pytest.raises(NodeStoreError, match="another configuration"):
        HostStore(a, 5, tmp_path)
    with pytest.raises(ValueError, match="CPU torch.float32 tensor"):
        ha.write(1, K1, torch.zeros(3))
    ha.close()
    with pytest.raises(ValueError, match="model's identity"):
        StoreLayout(TINY, "")


def test_the_node_tiers_orders_run_on_the_real_store_and_a_bad_restore_is_dropped(tmp_path):
    """The bookkeeping (manager/core/node_tier.py) and the bytes together: orders run in their
    order on real stores, a write-down reads its host slot verified, a disk block with a flipped
    byte fails its prefetch, is reported, and leaves the tier (the pool recomputes it)."""
    lay = layout()
    host = HostStore(lay, 3, tmp_path)
    disk = DiskStore(lay, tmp_path / "d", 2 * (HEADER.size + lay.block_bytes))
    tier = NodeTier(host.num_slots, disk.num_slots, 16, lay.block_bytes)
    device = {d: block(lay, d) for d in (1, 2, 3)}

    def run(owner, orders):
        failed = []
        for o in orders:
            buf = lay.empty_block()
            if isinstance(o, Save) and o.to == "host":
                f = host.write(o.dst, o.key, device[o.src])
            elif isinstance(o, Save):
                f = host.read_into(o.src, o.key, buf) or disk.write(o.dst, o.key, buf)
            elif o.frm == "host":
                f = host.read_into(o.src, o.key, buf)
                if f is None:
                    device[o.dst] = buf
            else:
                f = disk.read_into(o.src, o.key, buf) or host.write(o.dst, o.key, buf)
            if f is not None:
                failed.append(o)
        tier.finish(owner, failed)
        return failed

    k1, k2, k3 = (bytes([i]) * 32 for i in (1, 2, 3))
    assert run(1, tier.save(1, 1, k1, None)) == [] and run(2, tier.save(2, 2, k2, None)) == []
    orders = tier.save(3, 3, k3, None)  # host slot 1 reused: k1 written down first
    assert orders == [Save("disk", 1, 1, k1), Save("host", 3, 1, k3)] and run(3, orders) == []
    (hit,) = tier.lookup([k1])
    raw = bytearray(disk.path(hit.slot).read_bytes())
    raw[-1] ^= 0x01
    disk.path(hit.slot).write_bytes(bytes(raw))
    orders = tier.prefetch("p", [hit])
    assert run("p", orders) == [orders[-1]]  # the disk block did not verify
    assert tier.lookup([k1]) == [] and tier.disk.stats.verify_failures == 1
    (hit,) = tier.lookup([k3])
    tier.hold("l", [hit])
    assert run("l", tier.load("l", [hit], [9])) == [] and torch.equal(device[9], device[3])
    tier.check_invariants()
    host.close()
