"""A start-over (PROTOCOL.md section 11: the store went back, a new state id) tells KV-event
subscribers: every pool the manager had and no longer has gets ``AllBlocksCleared`` on its
topic, so a subscriber applying the events ends with the manager's view, not the old one.

The manager runs in this process on the real Redis, binds its real PUB socket, and a real SUB
socket decodes each batch with the vLLM release's own struct definitions (both formats).
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq
from helpers.durable import call, dump_keys, put_back, redis_or_skip
from helpers.manager import SPEC, free_port, kv_bytes, ok, shared_prefix_allocs, wait_until
from helpers.vllm_structs import V011, V033

from kvpool.manager.config import ManagerConfig
from kvpool.manager.core.kv_events import AllBlocksCleared
from kvpool.manager.server import Server

STRUCTS = {"vllm-0.33": V033, "vllm-0.11": V011}


class Subscriber:
    """A KV-aware router's view: {pool topic: cached hashes}, from the PUB socket alone."""

    def __init__(self, ctx: zmq.Context, endpoint: str, fmt: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batch_type = STRUCTS[fmt].KVEventBatch
        self.view: dict[str, set[bytes]] = {}
        self.cleared: list[str] = []

    def drain(self, srv: Server) -> None:
        """Applies every batch published so far (the loop's commit publishes them)."""
        srv._commit([])
        while self.sock.poll(300):
            topic, _seq, payload = self.sock.recv_multipart()
            pool = topic.decode()
            cached = self.view.setdefault(pool, set())
            for ev in msgspec.msgpack.decode(payload, type=self.batch_type).events:
                kind = type(ev).__name__
                if kind == "BlockStored":
                    cached.update(ev.block_hashes)
                elif kind == "BlockRemoved":
                    cached.difference_update(ev.block_hashes)
                elif kind == "AllBlocksCleared":
                    cached.clear()
                    self.cleared.append(pool)


def manager_view(srv: Server) -> dict[str, set[bytes]]:
    return {name: set(e.pool.blocks.cached) for name, e in srv.registry.pools.items() if e.pool is not None}


def fill(srv: Server, sid: str, pool: str, rng: random.Random, first_rid: int) -> None:
    ops = shared_prefix_allocs(rng, first_rid)
    assert all(r["ok"] for r in ok(call(srv, "step", sid, pool=pool, epoch=1, ops=ops))["results"])
    ok(call(srv, "step", sid, pool=pool, epoch=1, ops=[{"op": "free", "req": op["req"]} for op in ops[:2]]))


@pytest.mark.redis
@pytest.mark.parametrize("fmt", sorted(STRUCTS))
def test_a_start_over_clears_every_pool_a_subscriber_holds(namespace, tmp_path, fmt):
    r = redis_or_skip()
    events_ep = f"tcp://127.0.0.1:{free_port()}"
    srv = Server(ManagerConfig(endpoint=f"ipc://{tmp_path}/m.sock", redis_url="redis://127.0.0.1:6379/0",
                               namespace=namespace, high_water_file=str(tmp_path / "hw.seq"),
                               events_endpoint=events_ep, events_format=fmt))
    ctx = zmq.Context()
    try:
        srv.bind()
        srv._activate(time.monotonic())
        sub = Subscriber(ctx, events_ep, fmt)

        def joined() -> bool:  # PUB drops what it sends before the subscription arrives
            srv.publisher.publish("probe", 1, [AllBlocksCleared()])
            sub.drain(srv)
            return "probe" in sub.cleared
        wait_until(joined, 10, "the subscription")
        sids = {}
        for i, pool in enumerate(("a", "b")):
            sids[pool] = ok(call(srv, "hello"))["sid"]
            ok(call(srv, "register", sids[pool], pool=pool, shard_rank=0, shard_count=1, incarnation=pool,
                    spec=SPEC, available_kv_bytes=kv_bytes(64)))
            fill(srv, sids[pool], pool, random.Random(i), 100 * i)
            if pool == "a":
                sub.drain(srv)
                copy = dump_keys(r, namespace)  # an older copy: pool b does not exist in it
        sub.drain(srv)
        before = manager_view(srv)
        assert before["a"] and before["b"] and {p: sub.view[p] for p in before} == before
        state = srv.registry.state_id
        put_back(r, namespace, copy)  # under the running manager: its next commit finds an older journal
        call(srv, "step", sids["a"], pool="a", epoch=1, ops=[{"op": "free", "req": 2}])
        assert srv._commit([]) == [] and srv.mode == "recovering"
        srv._activate(time.monotonic())
        assert srv.mode == "active" and srv.registry.state_id != state
        sub.cleared.clear()
        sub.drain(srv)
        after = manager_view(srv)
        assert after == {}  # a new, empty state
        assert sorted(set(sub.cleared)) == ["a", "b"]
        assert {p: sub.view[p] for p in before} == {p: after.get(p, set()) for p in before}
    finally:
        ctx.destroy(linger=0)
        srv.close()
