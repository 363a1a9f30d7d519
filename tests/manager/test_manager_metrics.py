"""The manager's Prometheus endpoint, scraped over HTTP while clients step."""

from __future__ import annotations

import random

import pytest
import zmq
from helpers.manager import (
    SPEC,
    LiveServer,
    free_port,
    kv_bytes,
    sample,
    scrape,
    shared_prefix_allocs,
    value,
    wait_until,
)

from kvpool.client.manager import ManagerClient
from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.protocol import encode_request


@pytest.fixture
def metered(sock_dir):
    port = free_port()
    live = LiveServer(endpoint=f"ipc://{sock_dir}/m.sock", metrics_port=port)
    clients = []

    def client(identity: str, role: str = "worker") -> ManagerClient:
        c = ManagerClient(live.endpoint, identity=identity, role=role, timeout_s=5)
        clients.append(c)
        return c

    yield live, port, client
    for c in clients:
        c.close()
    live.stop()


def test_metrics_follow_steps_hits_no_space_and_evictions(metered):
    live, port, client = metered
    a, b = client("a"), client("b", role="admin")  # b steps on a's pool: only an admin may
    epoch = a.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                       available_kv_bytes=kv_bytes(24))["epoch"]
    rng = random.Random(0)
    steps, rid = 0, 0
    for c in (a, b, a, b, a, b):  # shared prefixes across clients; freed tails get evicted later
        ops = shared_prefix_allocs(rng, rid)
        rid += len(ops)
        assert all(r["ok"] for r in c.step("p", epoch, ops))
        c.step("p", epoch, [{"op": "free", "req": op["req"]} for op in ops])
        steps += 2
    big = [{"op": "alloc", "req": 999, "hashes": [], "prompt_len": 500, "max_new": 500}]
    assert a.step("p", epoch, big)[0]["code"] == "no_space"
    steps += 1
    with pytest.raises(Exception, match="unknown_pool"):
        a.step("nope", 1, [])
    pools = a.stats()["pools"]["p"]

    def caught_up() -> bool:
        m = scrape(port)
        return sample(m, "kvpool_pool_allocations_total", pool="p") == pools["allocations"] and \
            sample(m, "kvpool_ops_total", op="stats") >= 1

    wait_until(caught_up, 10, "the metrics text to catch up")
    m = scrape(port)
    assert pools["hit_tokens"] > 0 and pools["evictions"] > 0
    for metric, key in (("kvpool_pool_hit_tokens_total", "hit_tokens"), ("kvpool_pool_lookup_tokens_total",
                        "lookup_tokens"), ("kvpool_pool_no_space_total", "no_space"),
                        ("kvpool_pool_evictions_total", "evictions"), ("kvpool_pool_blocks_total", "num_blocks"),
                        ("kvpool_pool_blocks_free", "free_blocks"), ("kvpool_pool_blocks_cached", "cached_blocks"),
                        ("kvpool_pool_blocks_used", "used_blocks")):
        assert value(m, metric, pool="p") == pools[key], metric
    assert value(m, "kvpool_pool_no_space_total", pool="p") == 1
    assert value(m, "kvpool_pool_prefix_hit_rate", pool="p") == pytest.approx(pools["prefix_hit_rate"])
    assert value(m, "kvpool_pool_blocks_total", pool="p") == 24 and value(m, "kvpool_pool_ready", pool="p") == 1
    assert value(m, "kvpool_sessions") == 2 and value(m, "kvpool_pools") == 1
    assert value(m, "kvpool_step_latency_seconds_count") == steps
    assert value(m, "kvpool_ops_total", op="step") == steps + 1  # + the unknown pool's
    assert value(m, "kvpool_errors_total", code="unknown_pool") == 1
    assert value(m, "kvpool_store_commit_latency_seconds_count") > 0
    assert value(m, "kvpool_step_latency_seconds_bucket", le="+Inf") == steps
    assert value(m, "kvpool_manager_info", incarnation=live.server.incarnation) == 1


def test_metrics_are_off_by_default_and_a_taken_port_is_a_clear_error(sock_dir):
    srv = Server(ManagerConfig(endpoint=f"ipc://{sock_dir}/m.sock"))
    srv.bind()
    assert srv.hooks.metrics is None
    srv.close()
    live = LiveServer(endpoint=f"ipc://{sock_dir}/a.sock", metrics_port=free_port())
    try:
        clash = Server(ManagerConfig(endpoint=f"ipc://{sock_dir}/b.sock", metrics_port=live.server.hooks.metrics.port))
        with pytest.raises(RuntimeError, match="cannot serve metrics on 127.0.0.1:.*change metrics_port"):
            clash.bind()
        clash.close()
    finally:
        live.stop()


def test_bad_messages_show_up_as_error_counters(metered):
    live, port, _ = metered
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(live.endpoint)
    for payload in (b"\xc1", encode_request(1, "nope", None, {})):  # not msgpack; an unknown op
        sock.send(payload)
        assert sock.poll(5000)
        sock.recv()
    sock.close(0)
    ctx.term()
    wait_until(lambda: sample(scrape(port), "kvpool_errors_total", code="unknown_op") == 1, 10, "a render")
    m = scrape(port)
    assert value(m, "kvpool_errors_total", code="bad_message") == 1
    assert value(m, "kvpool_messages_total") >= 2


def test_attached_servers_get_their_mirrors_figures():
    from kvpool.manager.external.mirror import Mirror
    from kvpool.manager.metrics import render
    from kvpool.manager.registry import Registry
    from kvpool.manager.stats import ServerStats

    m = Mirror("v0", 4)
    m.live(0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                "block_size": 4, "medium": "GPU", "lora_name": None}])
    m.live(2, [])  # a gap: a replay asked
    text = render(Registry("x", session_timeout_s=10.0), ServerStats(), 1.0,
                  [{"name": "v0", **m.summary()}, {"name": "v1", **Mirror("v1", 4).summary()}])
    assert 'kvpool_external_blocks{medium="GPU",pool="v0"} 1' in text
    assert 'kvpool_external_gaps_total{pool="v0"} 1' in text and 'kvpool_external_replays_total{pool="v0"} 1' in text
    assert 'kvpool_external_stale{pool="v0"} 0' in text and 'kvpool_external_stale{pool="v1"} 1' in text
