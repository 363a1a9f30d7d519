"""The node tier under durable manager state, against the real Redis (sync mode): its index, its
open batches and the pins are journaled and snapshotted with the rest, so a restarted manager
recovers them exactly (and replays its journal against the index the live one ran); the files a
recovered index names are kept (every read verifies them), the rest dropped; `kvpool snapshot`
and `kvpool restore` carry the pins with their holdings."""

from __future__ import annotations

import os
import random

import pytest
from helpers.durable import (
    REDIS_URL,
    call,
    drop_namespace,
    durable_server,
    new_namespace,
    redis_or_skip,
    state_of,
)
from helpers.kv_spec import SPEC
from helpers.manager import kv_bytes, ok

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.snapshots import load_file, load_namespace, restore_namespace, save_file
from kvpool.manager.store.state_file import decode_state, encode_state
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_tier import host_file

pytestmark = pytest.mark.redis
MODEL = "preset:test:seed=0"
EP = "ipc:///tmp/kvpool-node-durable-test.sock"
PREFIXES = [list(range(1000 * k, 1000 * k + 16)) for k in range(6)]  # 4 blocks of 4 each


@pytest.fixture
def ns():
    r = redis_or_skip()
    names = [new_namespace(), new_namespace()]
    yield names
    for name in names:
        drop_namespace(r, name)
    r.close()


def server(name: str, tmp, **cfg):
    node = {"node_tier_memory": 64 * 1024, "node_tier_dir": str(tmp), "node_tier_disk": str(tmp / "d"),
            "node_tier_disk_size": 128 * 1024, "node_tier_policy": "write_through"}
    # a Redis timeout well past a busy Redis's pauses (another client's 1-4 s script made every
    # test here answer store_unavailable): none of these tests is about a timeout
    return durable_server(EP, redis_url=REDIS_URL, namespace=name, lease_ms=10_000, redis_timeout_s=3.0,
                          durability="sync", **{**node, **cfg})


def join(srv, pool: str) -> str:
    sid = ok(call(srv, "hello"))["sid"]
    ok(call(srv, "register", sid, pool=pool, shard_rank=0, shard_count=1, incarnation=pool, spec=SPEC,
            available_kv_bytes=kv_bytes(24), node_model=MODEL))
    return sid


def alloc(srv, sid: str, pool: str, rid: int, tokens: list[int], reports: list | None = None) -> dict:
    op = {"op": "alloc", "req": rid, "hashes": hash_blocks(tokens, 4), "prompt_len": len(tokens),
          "max_new": len(tokens)}
    (res,) = ok(call(srv, "step", sid, pool=pool, epoch=1, ops=[op], node_done=reports or []))["results"]
    return res


def workload(srv, steps: int, seed: int = 0) -> tuple[dict[str, str], dict[str, list], str]:
    """Two pools of one layout on shared prefixes: loads, saves, write-downs, failed orders
    reported a step late, pins, unpins, node-host evictions; the last batches left open."""
    rng = random.Random(seed)
    sids = {p: join(srv, p) for p in ("a", "b")}
    admin = ok(call(srv, "hello", role="admin"))["sid"]
    open_batches: dict[str, list] = {p: [] for p in sids}
    pins: list[int] = []
    for i in range(steps):
        p = rng.choice("ab")
        reports = []
        for batch, orders in open_batches[p]:
            failed = [o for o in orders if rng.random() < 0.1]
            reports.append({"batch": batch, "failed": failed} if failed else {"batch": batch})
        tokens = rng.choice(PREFIXES) + [rng.randrange(5) for _ in range(rng.randrange(1, 9))]
        res = alloc(srv, sids[p], p, i, tokens, reports)
        open_batches[p] = [(res["node"]["batch"], res["node"].get("pre", []) + res["node"].get("post", []))] \
            if "node" in res else []
        ok(call(srv, "step", sids[p], pool=p, epoch=1, ops=[{"op": "free", "req": i}]))
        if i % 7 == 3:
            got = call(srv, "pin", admin, pool=p, hashes=hash_blocks(rng.choice(PREFIXES), 4), ttl_s=600.0)
            if got["status"] == "ok":
                pins.append(got["body"]["pin_id"])
        if i % 13 == 8 and pins:
            ok(call(srv, "unpin", admin, pin_id=pins.pop(0)))
        if i % 11 == 5:
            ok(call(srv, "evict", admin, pool=p, n=3, tier="node_host"))
        assert srv._commit([]) == [] and srv.mode == "active"
    return sids, open_batches, admin


def test_a_restarted_manager_recovers_the_node_tiers_index_batches_and_pins(ns, tmp_path):
    srv = server(ns[0], tmp_path, snapshot_bytes=8192)  # compactions: snapshot and journal both carry it
    sids, open_batches, admin = workload(srv, 90)
    srv.store.wait_for_snapshot()
    assert srv.store.stats()["snapshots"] >= 2 and srv.store.stats()["seq"] > srv.store.stats()["snapshot_seq"]
    before = state_of(srv.registry)
    (usage,) = ok(call(srv, "stats", admin))["manager"]["node_tiers"].values()
    assert usage["batches"] > 0 and usage["pins"] > 0 and usage["disk"]["cached_blocks"] > 0
    assert usage["host"]["save_failures"] + usage["host"]["verify_failures"] + usage["disk"]["save_failures"] > 0

    back = server(ns[0], tmp_path)  # the same endpoint: it takes the lease back at once
    assert back.mode == "active" and state_of(back.registry) == before
    back.registry.check_invariants()
    # the batches open at the restart are reported to the new manager, which finishes them
    for p, batches in open_batches.items():
        reports = [{"batch": b} for b, _ in batches]
        assert ok(call(back, "node_done", sids[p], pool=p, reports=reports))["finished"] == len(batches)
    (usage,) = ok(call(back, "stats", admin))["manager"]["node_tiers"].values()
    assert usage["batches"] == 0
    # a prefix pool a computed after the restart is loaded by pool b from the recovered tier
    tokens = list(range(70_000, 70_017))
    res = alloc(back, sids["a"], "a", 10_000, tokens)
    assert "node" in res, res
    ok(call(back, "node_done", sids["a"], pool="a", reports=[{"batch": res["node"]["batch"]}]))
    res_b = alloc(back, sids["b"], "b", 10_000, tokens)
    assert res_b["cached"] == 16 and [o["op"] for o in res_b["node"]["pre"]] == ["load"] * 4
    back.registry.check_invariants()


def test_a_manager_configured_otherwise_replays_the_tier_the_live_one_ran(ns, tmp_path):
    """The journal carries the settings each registration joined under: a manager restarted with
    another node-tier size, or none, recovers the same index and keeps serving its pools from it."""
    srv = server(ns[0], tmp_path, snapshot_bytes=1 << 30)  # no compaction: everything replays from the journal
    sids, _, admin = workload(srv, 40)
    assert srv.store.stats()["snapshot_seq"] == 0
    before = state_of(srv.registry)
    recovered = before["node_tiers"][0][0]
    for cfg in ({"node_tier_memory": 32 * 1024}, {"node_tier_memory": 0, "node_tier_disk": None,
                                                 "node_tier_disk_size": 0}):
        back = server(ns[0], tmp_path, **cfg)
        assert back.mode == "active" and state_of(back.registry) == before, cfg
        back.registry.check_invariants()
        assert alloc(back, sids["b"], "b", 500, PREFIXES[0] + [1])["cached"] > 0  # b keeps its recovered tier
        sid = ok(call(back, "hello"))["sid"]
        body = ok(call(back, "register", sid, pool="c", shard_rank=0, shard_count=1, incarnation="c", spec=SPEC,
                       available_kv_bytes=kv_bytes(24), node_model=MODEL))
        # a new pool of the layout joins its recovered tier, as recovered; with the tier off, none
        assert body.get("node_tier") == (recovered if cfg["node_tier_memory"] else None)
        back.store.close()


def test_the_files_a_recovered_index_names_are_kept_and_the_rest_dropped(ns, tmp_path):
    srv = server(ns[0], tmp_path)
    workload(srv, 40)
    (info, tier), = srv.registry.node_tier_list()
    disk = tmp_path / "d" / info.layout
    for slot in range(1, info.disk_slots):  # what workers left: a file per slot, and a dead writer's
        (disk / f"{slot:010d}.kv").write_bytes(b"x")
    (disk / ".0000000001.123.0.tmp").write_bytes(b"x")
    named = {b for b in range(1, info.disk_slots) if tier.disk.blocks.block_hash[b] is not None}
    assert 0 < len(named) < info.disk_slots - 1
    host = host_file(str(tmp_path), info.layout)
    with open(host, "r+b") as f:
        f.seek(info.host_slots * 576 - 1)
        f.write(b"\x7f")  # a worker's bytes: kept, the index names its slots
    srv.registry.node.ready.clear()  # (this process set them up once already)

    back = server(ns[0], tmp_path)
    assert back.mode == "active"
    assert {int(f.name[:-3]) for f in disk.iterdir()} == named
    assert os.path.getsize(host) == info.host_slots * 576
    with open(host, "rb") as f:
        f.seek(info.host_slots * 576 - 1)
        assert f.read(1) == b"\x7f"


@pytest.mark.parametrize("snapshot_bytes", [1 << 30, 1024], ids=["journal", "snapshot"])
def test_a_tensor_parallel_pools_tier_recovers_with_a_store_per_rank(ns, tmp_path, snapshot_bytes):
    srv = server(ns[0], tmp_path, snapshot_bytes=snapshot_bytes)
    sids = {}
    for pool in ("a", "b"):  # two pools of two ranks: the tier is shared, computed blocks saved at once
        for rank in (0, 1):
            sid = ok(call(srv, "hello"))["sid"]
            body = ok(call(srv, "register", sid, pool=pool, shard_rank=rank, shard_count=2, incarnation=f"{rank}",
                           spec=SPEC, available_kv_bytes=kv_bytes(24), node_model=MODEL))
            sids.setdefault(pool, sid)
    stores = body["node_tier"]["stores"]
    res = alloc(srv, sids["a"], "a", 1, PREFIXES[0])
    ok(call(srv, "node_done", sids["a"], pool="a", reports=[{"batch": res["node"]["batch"]}]))
    assert srv._commit([]) == [] and srv.mode == "active"
    srv.store.wait_for_snapshot()
    assert (srv.store.stats()["snapshot_seq"] > 0) == (snapshot_bytes < 4096)  # snapshot: the tier's info in it
    before = state_of(srv.registry)
    for s in stores:
        (tmp_path / "d" / s / "0000000099.kv").write_bytes(b"x")  # no slot of the index: dropped
    srv.registry.node.ready.clear()

    back = server(ns[0], tmp_path)
    assert back.mode == "active" and state_of(back.registry) == before
    (info, _), = back.registry.node_tier_list()
    assert list(info.stores) == stores and info.layout == stores[0]
    for s in stores:
        assert os.path.getsize(host_file(str(tmp_path), s)) == info.host_slots * 576
        assert not (tmp_path / "d" / s / "0000000099.kv").exists()
    assert alloc(back, sids["b"], "b", 2, PREFIXES[0])["cached"] == 12  # 3 of the 4 blocks: the last is computed
    back.registry.check_invariants()


def test_snapshot_and_restore_carry_pins_with_their_holdings(ns, tmp_path):
    srv = server(ns[0], tmp_path)
    sid = join(srv, "a")
    join(srv, "b")  # the layout shared: a's computed blocks are saved at once
    admin = ok(call(srv, "hello", role="admin"))["sid"]
    res = alloc(srv, sid, "a", 1, PREFIXES[0] + [1])
    ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": res["node"]["batch"]}]))
    ok(call(srv, "step", sid, pool="a", epoch=1, ops=[{"op": "free", "req": 1}]))
    pin = ok(call(srv, "pin", admin, pool="a", hashes=hash_blocks(PREFIXES[0], 4), ttl_s=3600.0))
    assert pin["device_blocks"] == 4
    assert srv._commit([]) == []

    reg, seq = load_namespace(REDIS_URL, ns[0])
    path = str(tmp_path / "state.snap")
    save_file(reg, seq, path)
    reg2, seq2 = load_file(path)
    assert [p.pin_id for p in reg2.pins.pins.values()] == [pin["pin_id"]]
    restore_namespace(reg2, seq2, REDIS_URL, ns[1], force=False, keep_state_id=False)
    srv.store.close()
    back = server(ns[1], tmp_path)
    admin = ok(call(back, "hello", role="admin"))["sid"]
    assert [p["pin_id"] for p in ok(call(back, "pins", admin))["pins"]] == [pin["pin_id"]]
    assert ok(call(back, "evict", admin, pool="a", n=100))["evicted"] == 0  # the pin holds its 4 blocks
    ok(call(back, "unpin", admin, pin_id=pin["pin_id"]))
    assert ok(call(back, "evict", admin, pool="a", n=100))["evicted"] == 4
    back.registry.check_invariants()

    d = decode_state(open(path, "rb").read())  # a snapshot that kept the holdings without their pins
    del d["pins"]
    with open(path, "wb") as f:
        f.write(encode_state(d))
    with pytest.raises(CorruptState, match="holds blocks for pin"):
        load_file(path)


@pytest.mark.parametrize("snapshot_bytes", [1024, 1 << 30], ids=["snapshots", "journal"])
def test_an_engines_tier_its_batches_and_its_place_in_front_recover(ns, tmp_path, snapshot_bytes):
    """An engine that owns its device blocks (vLLM's connector): its node_join, saves and an open
    batch recover from snapshots or from the journal alone, on a manager started without a node
    tier too; the pool beside it keeps saving eagerly for it (the engine is still in front)."""
    srv = server(ns[0], tmp_path, snapshot_bytes=snapshot_bytes)
    eng = ok(call(srv, "hello"))["sid"]
    layout = ok(call(srv, "node_join", eng, spec=SPEC, node_model=MODEL))["node_tier"]["layout"]
    saved = hash_blocks(PREFIXES[1], 4)
    for batch, hashes in enumerate([saved[:2], saved[2:]], start=1):
        ok(call(srv, "node_save", eng, layout=layout, batch=batch, blocks=[1, 2], hashes=hashes,
                parents=[None if batch == 1 else saved[1], hashes[0]]))
    ok(call(srv, "node_done", eng, layout=layout, reports=[{"batch": 1}]))  # batch 2 left open
    sid = join(srv, "a")
    assert srv._commit([]) == [] and srv.mode == "active"
    srv.store.wait_for_snapshot()
    before = state_of(srv.registry)
    assert (srv.store.stats()["snapshot_seq"] > 0) == (snapshot_bytes == 1024)

    for cfg in ({}, {"node_tier_memory": 0, "node_tier_disk": None, "node_tier_disk_size": 0}):
        back = server(ns[0], tmp_path, **cfg)
        assert back.mode == "active" and state_of(back.registry) == before, cfg
        back.registry.check_invariants()
        (tier,) = [t for _, t in back.registry.node_tier_list()]
        assert tier.engines == {eng} and tier.eager
    # the last one (no node tier configured) serves the engine and the pool from the recovered tier
    assert ok(call(back, "node_done", eng, layout=layout, reports=[{"batch": 2}]))["finished"] == 1
    assert ok(call(back, "node_lookup", eng, layout=layout, hashes=saved))["blocks"] == 4
    res = alloc(back, sid, "a", 1, PREFIXES[2] + [1])
    host_saves = [o for o in res["node"]["post"] if o["op"] == "save" and o["level"] == "host"]
    assert len(host_saves) == 4  # saved at once for the engine (each written down to disk too)


def test_a_manager_without_a_node_tier_reports_the_recovered_ones(ns, tmp_path):
    srv = server(ns[0], tmp_path)
    workload(srv, 10)
    back = server(ns[0], tmp_path, node_tier_memory=0, node_tier_disk=None, node_tier_disk_size=0)
    admin = ok(call(back, "hello", role="admin"))["sid"]
    (usage,) = ok(call(back, "stats", admin))["manager"]["node_tiers"].values()
    assert usage["host_file"] == host_file(str(tmp_path), back.registry.node_tier_list()[0][0].layout)
