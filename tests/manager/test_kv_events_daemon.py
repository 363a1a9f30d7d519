"""KV events from a real daemon: a subscriber rebuilds the manager's cached-hash set (slow)."""

from __future__ import annotations

import json
import random
import subprocess
import time

import msgspec
import pytest
import zmq
from helpers.manager import CLI, SPEC, kv_bytes, shared_prefix_allocs, wait_until
from helpers.vllm_structs import V011

from kvpool.client.manager import ManagerClient, ManagerError, ManagerUnavailable
from kvpool.manager.event_client import TIER_MEDIUM, CachedView
from kvpool.manager.events import END_SEQ, decode_batch
from kvpool.shared.hashing import hash_blocks

pytestmark = pytest.mark.slow


def subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A SUB socket on every topic of the events endpoint."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def wait_for_daemon(c: ManagerClient) -> None:
    """Until the daemon answers ``c`` (short timeouts while it starts), then 10 s per call."""
    def up() -> bool:
        try:
            return bool(c.hello())
        except ManagerUnavailable:
            return False

    wait_until(up, 30, "the daemon to answer")
    c.timeout_s = 10


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(start.to_bytes(8, "big"))
    out = []
    while sock.poll(5000):
        *topic, seq_b, payload = sock.recv_multipart()  # vllm-0.33: [topic, seq, payload]
        if int.from_bytes(seq_b, "big") == END_SEQ:
            break
        assert topic in ([b"p"], [b"q"])
        out.append((int.from_bytes(seq_b, "big"), payload))
    sock.close(0)
    return out


def workload(a: ManagerClient, b: ManagerClient) -> None:
    """Two pools; shared prefixes across clients; churn that evicts; an admin evict; a reset."""
    epochs = {pool: c.register(pool, shard_rank=0, shard_count=1, incarnation=pool, spec=SPEC,
                               available_kv_bytes=kv_bytes(24))["epoch"] for pool, c in (("p", a), ("q", b))}
    rng, rid = random.Random(1), 0
    for i in range(12):
        pool = "pq"[i % 2]
        c = (a, b)[i // 2 % 2]
        ops = shared_prefix_allocs(rng, rid)
        rid += len(ops)
        assert all(r["ok"] for r in c.step(pool, epochs[pool], ops))
        c.step(pool, epochs[pool], [{"op": "free", "req": op["req"]} for op in ops])
        if i == 6:
            assert a.call("evict", pool="p", n=3)["evicted"] == 3
        if i == 7:
            assert a.call("reset_cache", pool="q")["reset"]


def test_subscriber_rebuilds_the_cached_set_from_events_alone(procs, sock_dir):
    ep, ev_ep, rp_ep = (f"ipc://{sock_dir}/{n}.sock" for n in ("m", "ev", "rp"))
    procs([*CLI, "manager", "-m", ep, "--events-endpoint", ev_ep, "--events-replay-endpoint", rp_ep])
    a = ManagerClient(ep, identity="a", role="admin", timeout_s=0.5)  # a and b step on each other's pools
    b = ManagerClient(ep, identity="b", role="admin", timeout_s=10)
    ctx = zmq.Context()
    sub = subscriber(ctx, ev_ep)
    try:
        wait_for_daemon(a)
        time.sleep(0.3)  # the subscription reaches the publisher before the first event
        workload(a, b)
        stats = a.stats()
        total = stats["manager"]["event_batches"]
        assert stats["pools"]["p"]["evictions"] > 0 and total > 10

        cached = {b"p": CachedView(), b"q": CachedView()}
        seqs, batches, kinds = [], {}, set()
        while len(seqs) < total:
            assert sub.poll(5000), f"got {len(seqs)} of {total} batches"
            topic, seq_b, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq_b, "big"))
            batches[seqs[-1]] = payload
            events = decode_batch(payload).events
            kinds.update(e["type"] for e in events)
            cached[topic].apply(events)
        assert seqs == list(range(total)), "one sequence, no gaps"
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        for pool in ("p", "q"):
            body = a.call("cached_hashes", pool=pool)
            assert body["event_batches"] == total
            assert cached[pool.encode()].hashes() == set(body["hashes"]) and body["total"] == len(body["hashes"])
        assert cached[b"p"].hashes(), "pool p still has a prefix cache"

        # the replay socket serves the same payloads; `kvpool events` prints them
        assert replay(ctx, rp_ep, 5) == [(s, batches[s]) for s in range(5, total)]
        out = subprocess.run([*CLI, "events", "-m", ep, "--replay-from", "0",  # the manager says where
                              "--count", str(total), "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [x["seq"] for x in lines] == list(range(total))
        assert {x["format"] for x in lines} == {"vllm-0.33"}
        stored = [e for x in lines for e in x["events"] if e["type"] == "BlockStored"]
        assert stored[0]["block_size"] == SPEC["block_size"] and len(bytes.fromhex(stored[0]["block_hashes"][0])) == 32
    finally:
        for c in (a, b):
            c.close()
        sub.close(0)
        ctx.term()


def test_events_format_flag_selects_vllm_0_11_arrays(procs, sock_dir):
    """`--events-format vllm-0.11`: vLLM 0.11.0's structs decode the batches, `kvpool events` names it."""
    ep, ev_ep = f"ipc://{sock_dir}/m.sock", f"ipc://{sock_dir}/ev.sock"
    procs([*CLI, "manager", "-m", ep, "--events-endpoint", ev_ep, "--events-format", "vllm-0.11"])
    tail = procs([*CLI, "events", "-e", ev_ep, "--count", "2", "--json"], stdout=subprocess.PIPE, text=True)
    c = ManagerClient(ep, identity="a", timeout_s=0.5)
    ctx = zmq.Context()
    sub = subscriber(ctx, ev_ep)
    try:
        wait_for_daemon(c)
        time.sleep(1.0)  # both subscriptions reach the publisher
        epoch = c.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                           available_kv_bytes=kv_bytes(24))["epoch"]
        ops = shared_prefix_allocs(random.Random(2), 0, n=2)
        assert all(r["ok"] for r in c.step("p", epoch, ops))
        c.step("p", epoch, [{"op": "free", "req": op["req"]} for op in ops])
        assert c.call("reset_cache", pool="p")["reset"]
        kinds = []
        while sub.poll(2000):
            batch = msgspec.msgpack.decode(sub.recv_multipart()[2], type=V011.KVEventBatch)
            kinds += [type(e).__name__ for e in batch.events]
        assert {"BlockStored", "AllBlocksCleared"} <= set(kinds)
        out, _ = tail.communicate(timeout=30)
        assert [json.loads(line)["format"] for line in out.splitlines()] == ["vllm-0.11", "vllm-0.11"]
    finally:
        c.close()
        sub.close(0)
        ctx.term()


def _chain(i: int) -> dict:
    toks = [1000 * i + t for t in range(17)]  # 4 full blocks of SPEC's 4 tokens and one more
    return {"op": "alloc", "req": i, "hashes": hash_blocks(toks, 4), "prompt_len": 17, "max_new": 17}


def test_a_subscriber_keeps_one_view_per_tier_on_a_pool_with_a_host_tier(procs, sock_dir):
    """Demotions store a hash on the host (``medium: "CPU"``) as the device removes it; a load
    stores it on the device again while the host keeps it; a device eviction then removes the
    device copy only. The subscriber's view per medium matches ``cached_hashes`` per tier."""
    ep, ev_ep = f"ipc://{sock_dir}/m.sock", f"ipc://{sock_dir}/ev.sock"
    procs([*CLI, "manager", "-m", ep, "--events-endpoint", ev_ep])
    c = ManagerClient(ep, identity="a", role="admin", timeout_s=0.5)
    ctx = zmq.Context()
    sub = subscriber(ctx, ev_ep)
    view = CachedView()

    def follow() -> None:
        total = c.stats()["manager"]["event_batches"]
        while follow.seen < total:
            assert sub.poll(5000), f"got {follow.seen} of {total} batches"
            _topic, seq_b, payload = sub.recv_multipart()
            assert int.from_bytes(seq_b, "big") == follow.seen
            follow.seen += 1
            view.apply(decode_batch(payload).events)
        for tier, medium in TIER_MEDIUM.items():
            body = c.call("cached_hashes", pool="p", tier=tier)
            assert body["tier"] == tier and body["event_batches"] == total
            assert view.hashes(medium) == set(body["hashes"]), tier

    follow.seen = 0
    try:
        wait_for_daemon(c)
        time.sleep(0.3)  # the subscription reaches the publisher before the first event
        epoch = c.register("p", shard_rank=0, shard_count=1, incarnation="w", spec=SPEC,
                           available_kv_bytes=kv_bytes(6), host_kv_bytes=kv_bytes(8))["epoch"]
        first = set(_chain(0)["hashes"])
        c.step("p", epoch, [_chain(0), {"op": "free", "req": 0}])
        res = c.step("p", epoch, [_chain(1), {"op": "free", "req": 1}])
        assert len(res[0]["saves"]) == 4  # chain 0 demoted: removed from the device, stored on the host
        follow()
        assert view.hashes("CPU") == first and not view.hashes("GPU") & first
        again = c.step("p", epoch, [_chain(0), {"op": "free", "req": 0}])[0]
        assert len(again["loads"]) == 4  # back on the device, still on the host
        follow()
        assert first <= view.hashes("GPU") and first <= view.hashes("CPU")
        assert c.call("evict", pool="p", n=10)["evicted"] > 0  # the device copies go, the host's stay
        follow()
        assert not view.hashes("GPU") and first <= view.hashes("CPU")
        c.step("p", epoch, [_chain(2), {"op": "free", "req": 2}])
        assert c.call("reset_cache", pool="p")["reset"]  # the device tier only: the host keeps its hashes
        follow()
        assert not view.hashes("GPU") and first <= view.hashes("CPU")
        assert c.call("cached_hashes", pool="p")["tier"] == "device"  # the default
        assert c.call("reset_cache", pool="p", tier="host")["reset"]
        follow()
        assert not view.hashes("CPU")
        with pytest.raises(ManagerError, match="tier"):
            c.call("cached_hashes", pool="p", tier="disk")
    finally:
        c.close()
        sub.close(0)
        ctx.term()
