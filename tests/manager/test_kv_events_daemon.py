"""KV events from a real daemon: a subscriber rebuilds the manager's cached-hash set (slow)."""

from __future__ import annotations

import json
import random
import subprocess
import time

import pytest
import zmq
from helpers.manager import CLI, SPEC, apply, kv_bytes, shared_prefix_allocs, wait_until

from kvpool.manager.events import END_SEQ, decode_batch
from kvpool.worker.manager_client import ManagerClient, ManagerUnavailable

pytestmark = pytest.mark.slow


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(start.to_bytes(8, "big"))
    out = []
    while sock.poll(5000):
        seq_b, payload = sock.recv_multipart()
        if int.from_bytes(seq_b, "big") == END_SEQ:
            break
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
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ev_ep)
    try:
        def up() -> bool:
            try:
                return bool(a.hello())
            except ManagerUnavailable:
                return False

        wait_until(up, 30, "the daemon to answer")
        a.timeout_s = 10
        time.sleep(0.3)  # the subscription reaches the publisher before the first event
        workload(a, b)
        stats = a.stats()
        total = stats["manager"]["event_batches"]
        assert stats["pools"]["p"]["evictions"] > 0 and total > 10

        cached: dict[bytes, set] = {b"p": set(), b"q": set()}
        seqs, batches, kinds = [], {}, set()
        while len(seqs) < total:
            assert sub.poll(5000), f"got {len(seqs)} of {total} batches"
            topic, seq_b, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq_b, "big"))
            batches[seqs[-1]] = payload
            events = decode_batch(payload)[1]
            kinds.update(e[0] for e in events)
            apply(cached[topic], events)
        assert seqs == list(range(total)), "one sequence, no gaps"
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        for pool in ("p", "q"):
            body = a.call("cached_hashes", pool=pool)
            assert body["event_batches"] == total
            assert cached[pool.encode()] == set(body["hashes"]) and body["total"] == len(body["hashes"])
        assert cached[b"p"], "pool p still has a prefix cache"

        # the replay socket serves the same payloads; `kvpool events` prints them
        assert replay(ctx, rp_ep, 5) == [(s, batches[s]) for s in range(5, total)]
        out = subprocess.run([*CLI, "events", "-e", ev_ep, "--replay-endpoint", rp_ep, "--replay-from", "0",
                              "--count", str(total), "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [x["seq"] for x in lines] == list(range(total))
        stored = [e for x in lines for e in x["events"] if e[0] == "BlockStored"]
        assert stored[0][4] == SPEC["block_size"] and len(bytes.fromhex(stored[0][1][0])) == 32
    finally:
        for c in (a, b):
            c.close()
        sub.close(0)
        ctx.term()
