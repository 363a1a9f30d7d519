"""Registration of a host tier: ``host_kv_bytes`` in ``register``, the pool's
host tier sized as the minimum over shards, kept through snapshots and journal replay; a pool
without it answers exactly as before."""

from __future__ import annotations

import pytest
from helpers.manager import SPEC, call, hello, kv_bytes, make_server, ok

from kvpool.manager.registry import Registry
from kvpool.manager.state.mutations import ShardRegistered, from_wire, to_wire
from kvpool.manager.store.state_file import dump_registry, load_registry
from kvpool.shared.protocol import KVSpec


def reg(srv, sid, rank=0, count=1, inc="i0", blocks=32, host_blocks=None, spec=SPEC, **extra):
    args = dict(pool="p", shard_rank=rank, shard_count=count, incarnation=inc, spec=spec,
                available_kv_bytes=kv_bytes(blocks), **extra)
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
    from kvpool.manager.state.mutations import BlocksEvicted, CacheReset
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


def test_the_host_policy_is_registered_answered_and_kept_through_journal_and_snapshot():
    srv = make_server()
    sid = hello(srv)
    body = ok(reg(srv, sid, host_blocks=8, host_kv_policy="write_through"))
    assert body["host_policy"] == "write_through"
    assert srv.registry.pools["p"].pool.host.policy == "write_through"
    assert reg(srv, sid, host_blocks=8)["status"] == "shard_conflict"  # same incarnation, other policy
    bad = call(srv, "register", hello(srv), pool="q", shard_rank=0, shard_count=1, incarnation="i0", spec=SPEC,
               available_kv_bytes=kv_bytes(32), host_kv_bytes=kv_bytes(8), host_kv_policy="write-back")
    assert bad["status"] == "bad_field" and "host_kv_policy" in bad["msg"] and "q" not in srv.registry.pools
    rec = ShardRegistered("s", "p", 0, 1, "i", KVSpec(**SPEC), 1, 2, 3, None, 0, "write_through")
    assert from_wire(to_wire(rec)) == rec and len(to_wire(rec)) == 13
    assert len(to_wire(ShardRegistered("s", "p", 0, 1, "i", KVSpec(**SPEC), 1, 2, 3))) == 10  # the old layout
    r = Registry("inc", session_timeout_s=10.0)
    s = r.open_session("w", "worker", True, 1, 0.0)
    r.register(s, "p", 0, 1, "a", KVSpec(**SPEC), kv_bytes(16), host_kv_bytes=kv_bytes(8),
               host_kv_policy="write_through")
    back = Registry("inc", session_timeout_s=10.0)
    load_registry(dump_registry(r, 7), back, 0.0)
    assert back.pools["p"].shards[0].host_kv_policy == "write_through"
    assert back.pools["p"].pool.host.policy == "write_through"


def test_write_through_only_when_every_shard_asks_for_it():
    srv = make_server()
    s0, s1 = hello(srv), hello(srv)
    ok(reg(srv, s0, rank=0, count=2, host_blocks=8, host_kv_policy="write_through"))
    assert ok(reg(srv, s1, rank=1, count=2, inc="i1", host_blocks=8))["host_policy"] == "demote"


def _chain(i: int) -> dict:
    from kvpool.shared.hashing import hash_blocks

    toks = [1000 * i + t for t in range(17)]  # 4 full blocks of SPEC's 4 tokens and one more
    return {"op": "alloc", "req": i, "hashes": hash_blocks(toks, 4), "prompt_len": 17, "max_new": 17}


@pytest.mark.parametrize("evict_first", [False, True], ids=["pressure-demotes", "manual-evict-drops"])
def test_a_manual_device_evict_drops_without_saving_while_pressure_demotes(evict_first):
    """``evict --tier device`` on a pool with a host tier forgets the hashes: no save is ordered,
    now or with the next step, and the chain is recomputed; the same reuse under pressure saves."""
    srv = make_server()
    sid = hello(srv)
    ok(reg(srv, sid, blocks=6, host_blocks=8))
    pool = srv.registry.pools["p"].pool
    first = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[_chain(0), {"op": "free", "req": 0}]))["results"]
    assert "saves" not in first[0]
    if evict_first:
        admin = hello(srv, role="admin")
        assert ok(call(srv, "evict", admin, pool="p", n=10))["evicted"] == 4
        assert pool.blocks.cached == {} and pool.host.blocks.cached == {}
    res = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[_chain(1), {"op": "free", "req": 1}]))["results"]
    saves = pool.host.stats.saves
    again = ok(call(srv, "step", sid, pool="p", epoch=1, ops=[_chain(0)]))["results"][0]
    if evict_first:
        assert "saves" not in res[0] and saves == 0
        assert again["cached"] == 0 and "loads" not in again
    else:
        assert len(res[0]["saves"]) == 4 and saves == 4
        assert again["cached"] == 16 and len(again["loads"]) == 4
    pool.check_invariants()


class RecordingSink:
    """An event sink that is not the NullSink: the server then builds KV events for it."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, pool: str, epoch: int, events: list) -> None:
        self.events += events

    def close(self) -> None:
        pass


@pytest.mark.parametrize("policy", ["demote", "write_through"])
@pytest.mark.parametrize("events", [False, True], ids=["events-off", "events-on"])
def test_the_host_tier_event_paths_with_events_off_and_on(policy, events):
    """Saves, writes, loads, a host evict and reset, a shard restart: with no events socket no
    KV event is built, none crashes; with one, the host tier's events carry medium CPU."""
    from kvpool.manager.config import ManagerConfig
    from kvpool.manager.server import Server

    sink = RecordingSink()
    srv = (Server(ManagerConfig(endpoint="ipc:///tmp/kvpool-unused.sock"), publisher=sink) if events
           else make_server())
    sid = hello(srv)
    ok(reg(srv, sid, blocks=6, host_blocks=8, host_kv_policy=policy))
    pool = srv.registry.pools["p"].pool
    admin = hello(srv, role="admin")
    for ops in ([_chain(0), {"op": "free", "req": 0}], [_chain(1), {"op": "free", "req": 1}], [_chain(0)],
                [{"op": "free", "req": 0}]):
        ok(call(srv, "step", sid, pool="p", epoch=1, ops=ops))
        srv._commit()
    assert pool.host.stats.loads >= 3 and (pool.host.stats.writes > 0) is (policy == "write_through")
    assert ok(call(srv, "evict", admin, pool="p", n=2, tier="host"))["evicted"] == 2
    assert ok(call(srv, "reset_cache", admin, pool="p", tier="host"))["reset"]
    srv._commit()
    ok(reg(srv, hello(srv), inc="i1", blocks=6, host_blocks=8, host_kv_policy=policy, replace=True))
    srv._commit()  # a re-formed pool: both tiers restated
    pool.check_invariants()
    cpu = [e for e in sink.events if getattr(e, "medium", None) == "CPU"]
    if not events:
        assert srv.stats.events == 0 and sink.events == [] and not pool.host.blocks.events_enabled
        return
    kinds = {type(e).__name__ for e in cpu}
    assert srv.stats.events == len(sink.events) and kinds == {"BlockStored", "BlockRemoved"}
    stored = {h for e in cpu if type(e).__name__ == "BlockStored" for h in e.hashes}
    assert set(_chain(0)["hashes"]) <= stored  # saved or written, then loaded back
