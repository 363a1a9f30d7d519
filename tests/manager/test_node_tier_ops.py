"""The node tier through the manager's ops (no sockets: ``handle_payload``): registration joins a
pool to its layout's tier, step results carry its orders, ``node_done`` finishes batches (bad
reports refused, nothing changed), pins hold blocks in the device tier and the node tier within
their share and expire, ``evict``/``reset_cache`` reach the node levels, stats report them."""

from __future__ import annotations

import time

import pytest
from helpers.kv_spec import SPEC
from helpers.manager import call, hello, kv_bytes, make_server, ok

from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_tier import layout_id
from kvpool.shared.protocol import KVSpec, encode_request, unpack

MODEL = "preset:test:seed=0"


@pytest.fixture
def srv(tmp_path):
    s = make_server(node_tier_memory=64 * 1024, node_tier_dir=str(tmp_path), node_tier_disk=str(tmp_path / "d"),
                    node_tier_disk_size=128 * 1024)
    join(s, "z")  # an idle second pool of the layout: the tier is shared, so blocks are saved as computed
    return s


def join(srv, pool: str, blocks: int = 16) -> tuple[str, dict]:
    sid = hello(srv)
    body = ok(call(srv, "register", sid, pool=pool, shard_rank=0, shard_count=1, incarnation=pool, spec=SPEC,
                   available_kv_bytes=kv_bytes(blocks), node_model=MODEL))
    return sid, body


def step(srv, sid, pool, ops, epoch=1, node_done=None, msg_id=7):
    """A step with message id ``msg_id`` (the tier numbers its batch: 1, 2, ... in its order)."""
    args = {"pool": pool, "epoch": epoch, "ops": ops}
    if node_done is not None:
        args["node_done"] = node_done
    return ok(unpack(srv.handle_payload(encode_request(msg_id, "step", sid, args), time.monotonic())))["results"]


def test_pools_of_one_layout_share_a_tier_and_a_step_carries_its_orders(srv, tmp_path):
    sid_a, body = join(srv, "a")
    info = body["node_tier"]
    assert info["layout"] == layout_id(KVSpec.from_wire(SPEC), MODEL).hex()
    assert (tmp_path / f"kvpool-node-{info['layout']}.host").stat().st_size == info["host_slots"] * 576  # 64 + 512
    sid_b, body_b = join(srv, "b")
    assert body_b["node_tier"] == info
    tokens = list(range(100, 117))  # 4 full blocks of 4, the last token in a fifth
    hashes = hash_blocks(tokens, 4)
    (res,) = step(srv, sid_a, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 17, "max_new": 17}])
    post = res["node"]["post"]
    assert res["node"]["batch"] == 1 and [o["op"] for o in post] == ["save"] * 4
    assert [o["src"] for o in post] == res["blocks"][:4] and [o["key"] for o in post] == hashes
    # b finds nothing until a reports the batch; then it loads 4 blocks
    (res_b,) = step(srv, sid_b, "b", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 17, "max_new": 17}])
    assert res_b["cached"] == 0
    assert ok(call(srv, "node_done", sid_a, pool="a", reports=[{"batch": 1}]))["finished"] == 1
    (res_b,) = step(srv, sid_b, "b", [{"op": "free", "req": 1, "computed": 0},  # never ran: b's hashes go
                                      {"op": "alloc", "req": 2, "hashes": hashes, "prompt_len": 17, "max_new": 17}],
                    msg_id=8)[1:]
    assert res_b["cached"] == 16 and [o["op"] for o in res_b["node"]["pre"]] == ["load"] * 4
    stats = ok(call(srv, "stats", sid_b))
    assert stats["pools"]["b"]["node_hit_tokens"] == 16
    (usage,) = stats["manager"]["node_tiers"].values()
    assert usage["host"]["hits"] == 4 and usage["batches"] == 1
    assert ok(call(srv, "check", hello(srv, role="admin")))


def test_a_bad_report_is_refused_and_changes_nothing(srv):
    sid, _ = join(srv, "a")
    hashes = hash_blocks(list(range(9)), 4)
    step(srv, sid, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 9, "max_new": 9}])
    stranger = {"op": "save", "level": "host", "src": 1, "dst": 1, "key": b"\x01" * 32}
    stranger_read = {"op": "load", "level": "disk", "src": 1, "dst": 1, "key": b"\x01" * 32}
    for bad in ([{"batch": 1, "failed": [stranger]}], [{"batch": "x"}], "no", [{"batch": 1, "failed": [{"op": 1}]}],
                [{"batch": 1, "late": [stranger]}],  # only a disk load has a deadline
                [{"batch": 1, "late": [stranger_read]}],  # not an order of the batch
                [{"batch": 1, "failed": [stranger_read], "late": [stranger_read]}], [{"batch": 1, "late": "x"}]):
        reply = call(srv, "node_done", sid, pool="a", reports=bad)
        assert reply["status"] == "bad_field", reply
    (usage,) = ok(call(srv, "stats", sid))["manager"]["node_tiers"].values()
    assert usage["batches"] == 1
    assert ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": 99}]))["finished"] == 0  # unknown: ignored


def test_a_failed_save_leaves_the_tier_and_a_session_end_abandons_its_batches(srv):
    sid, _ = join(srv, "a")
    hashes = hash_blocks(list(range(9)), 4)
    (res,) = step(srv, sid, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 9, "max_new": 9}])
    first = res["node"]["post"][0]
    assert ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": 1, "failed": [first]}]))["finished"] == 1
    (usage,) = ok(call(srv, "stats", sid))["manager"]["node_tiers"].values()
    assert usage["host"]["save_failures"] == 1 and usage["host"]["cached_blocks"] == 1
    assert usage["host"]["removed"]["failed"] == 1
    tokens = list(range(50, 59))
    step(srv, sid, "a", [{"op": "alloc", "req": 2, "hashes": hash_blocks(tokens, 4), "prompt_len": 9, "max_new": 9}],
         msg_id=8)
    ok(call(srv, "deregister", sid))
    (usage,) = ok(call(srv, "stats", hello(srv)))["manager"]["node_tiers"].values()
    assert usage["batches"] == 0 and usage["host"]["removed"]["failed"] == 3  # the two it was writing


def test_pins_hold_device_blocks_within_their_share_and_expire(srv):
    sid, _ = join(srv, "a", blocks=17)  # 16 usable: a share of 0.25 pins at most 4
    admin = hello(srv, role="admin")
    tokens = list(range(200, 221))
    hashes = hash_blocks(tokens, 4)
    step(srv, sid, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 21, "max_new": 21}])
    step(srv, sid, "a", [{"op": "free", "req": 1}])
    refused = call(srv, "pin", admin, pool="a", hashes=hashes, ttl_s=60.0)
    assert refused["status"] == "pin_refused" and "5 cached device blocks" in refused["msg"]
    assert "at most 4 pinned" in refused["msg"]
    pin = ok(call(srv, "pin", admin, pool="a", hashes=hashes[:3], ttl_s=60.0))
    assert pin["device_blocks"] == 3 and pin["node"] is True
    assert ok(call(srv, "evict", admin, pool="a", n=100))["evicted"] == 2  # the pinned three stay
    assert ok(call(srv, "lookup", admin, pool="a", hashes=hashes))["blocks"] == 3
    assert [p["pin_id"] for p in ok(call(srv, "pins", admin))["pins"]] == [pin["pin_id"]]
    assert srv.registry.expire_pins(time.time() + 61) == [pin["pin_id"]]
    assert ok(call(srv, "pins", admin))["pins"] == []
    assert ok(call(srv, "evict", admin, pool="a", n=100))["evicted"] == 3
    assert ok(call(srv, "check", admin))


def test_evict_and_reset_reach_the_node_levels(srv):
    sid, _ = join(srv, "a")
    admin = hello(srv, role="admin")
    hashes = hash_blocks(list(range(9)), 4)
    step(srv, sid, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 9, "max_new": 9}])
    assert call(srv, "reset_cache", admin, pool="a", tier="node_host")["status"] == "in_use"  # a batch holds them
    ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": 1}]))
    assert ok(call(srv, "evict", admin, pool="a", n=1, tier="node_host"))["evicted"] == 1
    assert ok(call(srv, "reset_cache", admin, pool="a", tier="node_host"))["reset"]
    (usage,) = ok(call(srv, "stats", admin))["manager"]["node_tiers"].values()
    assert usage["host"]["cached_blocks"] == 0 and usage["host"]["removed"]["cleared"] == 1
    assert call(srv, "evict", admin, pool="a", n=1, tier="node_nvme")["status"] == "bad_field"


def test_a_pool_without_node_model_gets_no_tier(srv):
    sid = hello(srv)
    body = ok(call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                   available_kv_bytes=kv_bytes(16)))
    assert "node_tier" not in body
    assert call(srv, "register", sid, pool="r", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                available_kv_bytes=kv_bytes(16), node_model="")["status"] == "bad_field"


def test_a_tensor_parallel_pool_gets_one_tier_with_a_store_per_rank(srv, tmp_path):
    def register(pool, rank, **kw):
        return ok(call(srv, "register", hello(srv), pool=pool, shard_rank=rank, shard_count=2, incarnation=f"{rank}",
                       spec=SPEC, available_kv_bytes=kv_bytes(16), **kw))

    assert "node_tier" not in register("q", 0, node_model=MODEL)  # pending: the tier is the whole pool's
    info = register("q", 1, node_model=MODEL)["node_tier"]
    spec = KVSpec.from_wire(SPEC)
    stores = [layout_id(spec, MODEL, r, 2).hex() for r in (0, 1)]
    assert info["stores"] == stores and info["layout"] == stores[0] != layout_id(spec, MODEL).hex()
    assert info["host_slots"] == 32 * 1024 // 576  # node_tier_memory split between the ranks' stores
    assert info["disk_bytes"] == 64 * 1024 and info["disk_slots"] == 64 * 1024 // 576 + 1
    for s in stores:  # every rank's files, made by the manager before the reply
        assert (tmp_path / f"kvpool-node-{s}.host").stat().st_size == info["host_slots"] * 576
        assert (tmp_path / "d" / s).is_dir()
    sid = hello(srv)
    ok(call(srv, "register", sid, pool="q", shard_rank=0, shard_count=2, incarnation="0", spec=SPEC,
            available_kv_bytes=kv_bytes(16), node_model=MODEL))  # rank 0 again: the reply names the tier now
    register("q2", 0, node_model=MODEL)
    assert register("q2", 1, node_model=MODEL)["node_tier"] == info  # a second pool of the layout shares it
    (res,) = step(srv, sid, "q", [{"op": "alloc", "req": 1, "hashes": hash_blocks(list(range(9)), 4),
                                   "prompt_len": 9, "max_new": 9}])
    assert [o["op"] for o in res["node"]["post"]] == ["save"] * 2  # the pool's orders, one batch for both ranks
    # a pool whose shards do not all offer it gets none (its ranks copy together or not at all)
    register("m", 0, node_model=MODEL)
    assert "node_tier" not in register("m", 1)
    assert ok(call(srv, "check", hello(srv, role="admin")))


def test_the_config_says_what_to_change(tmp_path):
    from kvpool.manager.config import ManagerConfig

    with pytest.raises(ValueError, match="needs both node_tier_disk"):
        ManagerConfig(node_tier_memory=1 << 20, node_tier_disk=str(tmp_path))
    with pytest.raises(ValueError, match="needs node_tier_memory"):
        ManagerConfig(node_tier_disk=str(tmp_path), node_tier_disk_size=1 << 20)
    with pytest.raises(ValueError, match="policy must be one of"):
        ManagerConfig(node_tier_memory=1 << 20, node_tier_policy="lru")
    with pytest.raises(ValueError, match="must be a directory"):
        ManagerConfig(node_tier_memory=1 << 20, node_tier_dir=str(tmp_path / "missing"))
    # durable: the node tier's index is journaled and snapshotted with the rest (test_node_tier_durable.py)
    ManagerConfig(node_tier_memory=1 << 20, node_tier_dir=str(tmp_path), redis_url="redis://127.0.0.1:6379/0")


def test_prometheus_renders_the_levels_and_the_pools_hits_by_level(srv):
    from kvpool.manager.metrics import render
    from kvpool.shared.metrics import parse_text

    sid, _ = join(srv, "a")
    hashes = hash_blocks(list(range(9)), 4)
    step(srv, sid, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 9, "max_new": 9}])
    ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": 1}]))
    text = render(srv.registry, srv.stats, 1.0)
    samples = parse_text(text)
    layout = next(iter(srv.registry.node.tiers))
    assert samples[("kvpool_node_tier_saves_total", (("layout", layout), ("level", "host")))] == 2
    assert samples[("kvpool_node_tier_blocks_cached", (("layout", layout), ("level", "host")))] == 2
    assert samples[("kvpool_node_tier_batches", (("layout", layout),))] == 0
    assert samples[("kvpool_pool_node_hit_tokens_total", (("level", "disk"), ("pool", "a")))] == 0


def test_a_client_that_reuses_step_ids_gets_a_batch_per_step(srv):
    """Batches are numbered by the tier, not by the client's step ids: a step id used again
    (not a retry: another step came between) opens its own batch, and a report finishes one."""
    sid, _ = join(srv, "a")
    batches = []
    for k, msg_id in enumerate((7, 8, 7)):
        tokens = list(range(300 + 20 * k, 309 + 20 * k))
        (res,) = step(srv, sid, "a", [{"op": "alloc", "req": k, "hashes": hash_blocks(tokens, 4), "prompt_len": 9,
                                       "max_new": 9}], msg_id=msg_id)
        batches.append(res["node"]["batch"])
    assert len(set(batches)) == 3
    assert ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": batches[0]}]))["finished"] == 1
    (usage,) = ok(call(srv, "stats", sid))["manager"]["node_tiers"].values()
    assert usage["batches"] == 2 and usage["host"]["cached_blocks"] == 6
    assert ok(call(srv, "check", hello(srv, role="admin")))


def test_a_reset_refused_for_pins_says_so_and_how_to_unpin(srv):
    sid, _ = join(srv, "a")
    admin = hello(srv, role="admin")
    hashes = hash_blocks(list(range(9)), 4)
    step(srv, sid, "a", [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 9, "max_new": 9}])
    step(srv, sid, "a", [{"op": "free", "req": 1}], msg_id=8)
    pin = ok(call(srv, "pin", admin, pool="a", hashes=hashes, ttl_s=60.0))
    refused = call(srv, "reset_cache", admin, pool="a")
    assert refused["status"] == "in_use" and "drain" not in refused["msg"]
    assert f"held by retention pins [{pin['pin_id']}]" in refused["msg"] and "kvpool unpin" in refused["msg"]
    step(srv, sid, "a", [{"op": "alloc", "req": 2, "hashes": [], "prompt_len": 3, "max_new": 3}], msg_id=9)
    refused = call(srv, "reset_cache", admin, pool="a")
    assert "held by retention pins" in refused["msg"] and "the rest by requests: drain it first" in refused["msg"]
    step(srv, sid, "a", [{"op": "free", "req": 2}], msg_id=10)
    ok(call(srv, "unpin", admin, pin_id=pin["pin_id"]))
    assert ok(call(srv, "reset_cache", admin, pool="a"))["reset"]
