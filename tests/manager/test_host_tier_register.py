"""Registration of a host tier: ``host_kv_bytes`` in ``register``, the pool's
host tier sized as the minimum over shards, kept through snapshots and journal replay; a pool
without it answers exactly as before."""

from __future__ import annotations

import pytest
from helpers.manager import SPEC, call, hello, kv_bytes, make_server, ok

from kvpool.manager.mutations import ShardRegistered, from_wire, to_wire
from kvpool.manager.registry import Registry
from kvpool.manager.store.state_file import dump_registry, load_registry
from kvpool.shared.protocol import KVSpec


def reg(srv, sid, rank=0, count=1, inc="i0", blocks=32, host_blocks=None, spec=SPEC):
    args = dict(pool="p", shard_rank=rank, shard_count=count, incarnation=inc, spec=spec,
                available_kv_bytes=kv_bytes(blocks))
    if host_blocks is not None:
        args["host_kv_bytes"] = kv_bytes(host_blocks, spec)
    return call(srv, "register", sid, **args)


def test_a_pool_without_host_memory_answers_as_before():
    srv = make_server()
    body = ok(reg(srv, hello(srv)))
    assert "host_num_blocks" not in body
    pools = ok(call(srv, "pools", hello(srv, role="admin")))["pools"]
    assert "host_num_blocks" not in pools[0] and "host_num_blocks" not in pools[0]["shards"][0]


def test_the_host_tier_is_the_minimum_over_shards_in_blocks_of_each_shards_page():
    srv = make_server()
    s0, s1 = hello(srv), hello(srv)
    assert "host_num_blocks" not in ok(reg(srv, s0, rank=0, count=2, host_blocks=100))  # pending
    # shard 1's pages hold twice the heads: the bytes of 70 two-head pages are 70 of its own
    body = ok(reg(srv, s1, rank=1, count=2, inc="i1", host_blocks=70, spec={**SPEC, "num_kv_heads": 4}))
    assert body["state"] == "ready" and body["host_num_blocks"] == 70
    shards = ok(call(srv, "pools", hello(srv, role="admin")))["pools"][0]["shards"]
    assert [s["host_num_blocks"] for s in shards] == [100, 70]


def test_a_shard_without_host_memory_leaves_the_pool_without_a_tier():
    srv = make_server()
    s0, s1 = hello(srv), hello(srv)
    ok(reg(srv, s0, rank=0, count=2, host_blocks=100))
    assert "host_num_blocks" not in ok(reg(srv, s1, rank=1, count=2, inc="i1"))


@pytest.mark.parametrize("bad", [-1, "4GiB", 1.5, None, 1 << 63])
def test_a_bad_host_kv_bytes_is_a_bad_field_and_registers_nothing(bad):
    srv = make_server()
    sid = hello(srv)
    r = call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i0", spec=SPEC,
             available_kv_bytes=kv_bytes(32), host_kv_bytes=bad)
    assert r["status"] == "bad_field" and "host_kv_bytes" in r["msg"]
    assert srv.registry.pools == {}


def test_the_same_incarnation_with_other_host_memory_is_a_conflict():
    srv = make_server()
    sid = hello(srv)
    ok(reg(srv, sid, host_blocks=10))
    assert ok(reg(srv, sid, host_blocks=10))["host_num_blocks"] == 10  # idempotent
    assert reg(srv, sid, host_blocks=11)["status"] == "shard_conflict"


def test_host_memory_survives_a_state_snapshot_and_an_old_snapshot_row_reads_as_none():
    r = Registry("inc", session_timeout_s=10.0)
    s = r.open_session("w", "worker", True, 1, 0.0)
    r.register(s, "p", 0, 1, "a", KVSpec(**SPEC), kv_bytes(16), host_kv_bytes=kv_bytes(40))
    d = dump_registry(r, 7)
    back = Registry("inc", session_timeout_s=10.0)
    load_registry(d, back, 0.0)
    assert back.pools["p"].host_num_blocks == 40
    assert d["pools"][0][3][0][6:] == [None, kv_bytes(40)]
    d["pools"][0][3][0] = d["pools"][0][3][0][:6]  # a row written before the host tier
    old = Registry("inc", session_timeout_s=10.0)
    load_registry(d, old, 0.0)
    assert old.pools["p"].host_num_blocks == 0 and old.pools["p"].shards[0].host_kv_bytes == 0


def test_a_register_record_keeps_host_bytes_and_an_old_record_replays_without():
    rec = ShardRegistered("s", "p", 0, 1, "a", KVSpec(**SPEC), 100, 64, 8, host_kv_bytes=4096)
    assert from_wire(to_wire(rec)) == rec and to_wire(rec)[-2:] == [None, 4096]
    assert from_wire(to_wire(rec)[:-2]).host_kv_bytes == 0  # journaled before the host tier
    served = ShardRegistered("s", "p", 0, 1, "a", KVSpec(**SPEC), 100, 64, 8, {"endpoint": "ipc:///x"}, 4096)
    assert from_wire(to_wire(served)) == served
    assert len(to_wire(ShardRegistered("s", "p", 0, 1, "a", KVSpec(**SPEC), 100, 64, 8))) == 10


def test_the_worker_client_offers_host_memory_over_a_real_socket(live_server):
    from kvpool.worker.block_manager import RemoteBlockManager

    live = live_server()
    bm = RemoteBlockManager([live.endpoint], "p", shard_rank=0, shard_count=1)
    spec = KVSpec(**SPEC)
    assert bm.register(spec, kv_bytes(16), kv_bytes(48))["host_num_blocks"] == 48
    assert live.server.registry.pools["p"].shards[0].host_kv_bytes == kv_bytes(48)
    bm.close()


def test_the_worker_config_takes_host_kv_memory_with_units_and_refuses_a_negative():
    from kvpool.worker.config import WorkerConfig, parse_bytes
    from kvpool.worker.startup import host_kv_share

    cfg = WorkerConfig(host_kv_memory=parse_bytes("64MiB"), tp_size=2)
    assert host_kv_share(cfg) == 32 << 20 and WorkerConfig().host_kv_memory == 0
    with pytest.raises(ValueError, match="host_kv_memory"):
        WorkerConfig(host_kv_memory=-1)


def test_a_new_incarnation_drops_both_tiers():
    r = Registry("inc", session_timeout_s=10.0)
    s = r.open_session("w", "worker", True, 1, 0.0)
    e = r.register(s, "p", 0, 1, "a", KVSpec(**SPEC), kv_bytes(16), host_kv_bytes=kv_bytes(8))
    e.pool.host.demote(3, b"h" * 32, None)
    e.pool.end_step()
    assert e.pool.host.lookup([b"h" * 32]) == [1]
    e = r.register(s, "p", 0, 1, "b", KVSpec(**SPEC), kv_bytes(16), host_kv_bytes=kv_bytes(8))
    assert e.epoch == 2 and e.pool.host.lookup([b"h" * 32]) == [] and e.pool.host.num_blocks == 8


def test_evict_and_reset_per_tier_are_journaled_and_refused_on_a_pool_without_one():
    srv = make_server()
    ok(reg(srv, hello(srv), host_blocks=8))
    admin = hello(srv, role="admin")
    pool = srv.registry.pools["p"].pool
    for b, i in ((3, 1), (4, 2)):
        pool.host.demote(b, i.to_bytes(32, "big"), None)
    pool.end_step()
    assert ok(call(srv, "evict", admin, pool="p", n=1, tier="host"))["evicted"] == 1
    assert len(pool.host.blocks.cached) == 1
    assert ok(call(srv, "reset_cache", admin, pool="p", tier="host"))["reset"] is True
    assert pool.host.blocks.cached == {}
    assert call(srv, "evict", admin, pool="p", n=1, tier="disk")["status"] == "bad_field"
    plain = make_server()
    ok(reg(plain, hello(plain)))
    r = call(plain, "evict", hello(plain, role="admin"), pool="p", n=1, tier="host")
    assert r["status"] == "bad_field" and "no host tier" in r["msg"]
    from kvpool.manager.mutations import BlocksEvicted, CacheReset
    assert to_wire(BlocksEvicted("p", 2)) == ["evict", "p", 2]  # the layout before the host tier
    assert from_wire(to_wire(CacheReset("p", "host"))) == CacheReset("p", "host")


def test_stats_metrics_and_the_pools_table_show_the_host_tier():
    from kvpool.manager.metrics import render

    srv = make_server()
    ok(reg(srv, hello(srv), host_blocks=8))
    admin = hello(srv, role="admin")
    stats = ok(call(srv, "stats", admin))["pools"]["p"]
    assert stats["host_num_blocks"] == 8 and stats["host_hit_tokens"] == 0
    assert ok(call(srv, "pools", admin))["pools"][0]["host_cached_blocks"] == 0
    text = render(srv.registry, srv.stats, 1.0)
    assert 'kvpool_pool_host_blocks_total{pool="p"} 8' in text
    plain = make_server()
    ok(reg(plain, hello(plain)))
    assert "kvpool_pool_host" not in render(plain.registry, plain.stats, 1.0)
