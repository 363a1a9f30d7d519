"""A subscriber built on vLLM 0.33.0's KV-event structs follows a durable daemon through stores,
evictions, an admin evict, a reset, a SIGKILL and the recovery, live and through the replay
socket, and ends with the manager's cached set (slow, Redis)."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq
from helpers.durable import Daemon
from helpers.manager import SPEC, kv_bytes
from helpers.vllm_structs import V033

from kvpool.client.manager import ManagerClient
from kvpool.manager.events import END_SEQ
from kvpool.shared.hashing import hash_blocks

pytestmark = [pytest.mark.slow, pytest.mark.redis]
SHARED = list(range(1000, 1032))  # 8 full blocks of 4, shared by every prompt
DECODER = msgspec.msgpack.Decoder(V033.KVEventBatch)


def churn(c: ManagerClient, epoch: int, rng: random.Random, first_rid: int, rounds: int) -> None:
    """Prompts sharing a prefix, freed at once: stores, and evictions once the 24 blocks run out."""
    for rid in range(first_rid, first_rid + rounds):
        toks = SHARED + [rng.randrange(32000) for _ in range(rng.randint(5, 16))]
        op = {"op": "alloc", "req": rid, "hashes": hash_blocks(toks, 4), "prompt_len": len(toks),
              "max_new": len(toks)}
        assert c.step("p", epoch, [op])[0]["ok"]
        c.step("p", epoch, [{"op": "free", "req": rid}])


def subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher
    return sub


def receive(sub: zmq.Socket, n: int) -> list[tuple[int, bytes]]:
    out = []
    while len(out) < n:
        assert sub.poll(10_000), f"got {len(out)} of {n} batches"
        topic, seq_b, payload = sub.recv_multipart()
        assert topic == b"p"
        out.append((int.from_bytes(seq_b, "big"), payload))
    return out


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """As vLLM 0.33's subscribers ask: a REQ-framed request, [topic, seq, payload] answers."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while sock.poll(5000):
        _, topic, seq_b, payload = sock.recv_multipart()
        if int.from_bytes(seq_b, "big") == END_SEQ:
            assert (topic, payload) == (b"", b"")
            break
        assert topic == b"p"
        out.append((int.from_bytes(seq_b, "big"), payload))
    sock.close(0)
    return out


def apply(cached: set, batch) -> list[str]:
    """A router's update from one decoded vLLM batch; returns the event kinds."""
    for ev in batch.events:
        if isinstance(ev, V033.BlockStored):
            assert (ev.medium, ev.block_size, ev.token_ids, ev.lora_name) == ("GPU", SPEC["block_size"], [], None)
            cached.update(ev.block_hashes)
        elif isinstance(ev, V033.BlockRemoved):
            cached.difference_update(ev.block_hashes)
        else:
            cached.clear()
    return [type(ev).__name__ for ev in batch.events]


def test_vllm_0_33_subscriber_follows_stores_evictions_reset_and_recovery(procs, sock_dir, namespace):
    ev_ep, rp_ep = f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/rp.sock"
    d = Daemon(procs, sock_dir, namespace, events_endpoint=ev_ep, events_replay_endpoint=rp_ep)
    ctx = zmq.Context()
    sub = subscriber(ctx, ev_ep)
    c = ManagerClient(d.endpoint, identity="w", timeout_s=0.5, failover_s=30.0)
    try:
        d.start()
        d.wait_active()
        time.sleep(0.3)  # the subscription reaches the publisher
        epoch = c.register("p", shard_rank=0, shard_count=1, incarnation="w", spec=SPEC,
                           available_kv_bytes=kv_bytes(24))["epoch"]
        rng, cached, kinds = random.Random(3), set(), []
        churn(c, epoch, rng, 0, 8)
        assert c.call("evict", pool="p", n=2)["evicted"] == 2
        assert c.call("reset_cache", pool="p")["reset"]
        churn(c, epoch, rng, 100, 6)
        before = c.stats()
        assert before["pools"]["p"]["evictions"] > 2
        for _, payload in receive(sub, before["manager"]["event_batches"]):
            kinds += apply(cached, DECODER.decode(payload))
        assert cached == set(c.call("cached_hashes", pool="p")["hashes"]) and cached

        d.kill()  # SIGKILL; the restarted daemon recovers the state from Redis
        cached_at_kill = set(cached)
        d.start()
        d.wait_active()
        # The SUB reconnects by itself, but libzmq attaches the new connection (and resends the
        # subscription) in the thread that uses the socket: a subscriber must keep polling, as a
        # router does. What it missed meanwhile (the recovery batch) is on the replay socket.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            sub.poll(50)
            time.sleep(0.05)
        churn(c, epoch, rng, 200, 3)  # resent by the client until the recovered manager answers
        total = c.stats()["manager"]["event_batches"]
        got = replay(ctx, rp_ep, 0)
        assert [s for s, _ in got] == list(range(total)), "the new publisher counts from 0"
        live = dict(receive(sub, 1))
        while sub.poll(500):
            live.update(receive(sub, 1))
        assert live and all(dict(got)[s] == payload for s, payload in live.items()), "replay == live"
        first = DECODER.decode(got[0][1])
        assert [type(e).__name__ for e in first.events] == ["AllBlocksCleared", "BlockStored"]
        assert set(first.events[1].block_hashes) == cached_at_kill, "the recovered cache is announced"
        for _, payload in got:
            kinds += apply(cached, DECODER.decode(payload))
        assert cached == set(c.call("cached_hashes", pool="p")["hashes"])
        assert set(kinds) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    finally:
        c.close()
        sub.close(0)
        ctx.term()
