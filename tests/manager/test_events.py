import re
import time

import msgpack
import msgspec
import pytest
import zmq
from helpers.vllm_structs import V011, V033, load_vllm_structs, vllm_sources

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvpool.manager.core.pool import Pool
from kvpool.manager.event_client import TIER_MEDIUM, CachedView
from kvpool.manager.events import END_SEQ, EventPublisher, decode_batch, encode_batch, encode_events
from kvpool.shared.hashing import hash_blocks

FORMAT_STRUCTS = {"vllm-0.33": V033, "vllm-0.11": V011}


def pool_events() -> tuple[list[bytes], list[KVEvent]]:
    """Stores (a chain and its continuation), an eviction, a reset: every kind of event."""
    pool = Pool(8, 4, enable_events=True)
    h = hash_blocks(list(range(12)), 4)
    pool.allocate(1, h[:2], 9, 9)
    pool.free(1)
    pool.allocate(2, h, 13, 13)  # hits h[0..1], stores h[2] with parent h[1]
    pool.free(2)
    pool.evict(1)
    pool.reset_prefix_cache()
    return h, pool.take_events()


def test_default_format_decodes_with_vllm_0_33_structs():
    h, events = pool_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    batch = msgspec.msgpack.decode(encode_batch(events, 4, ts=12.5), type=V033.KVEventBatch)
    assert (batch.ts, batch.data_parallel_rank) == (12.5, None)
    first, second, removed, cleared = batch.events
    assert first == V033.BlockStored(block_hashes=h[:2], parent_block_hash=None, token_ids=[], block_size=4,
                                     lora_id=None, medium="GPU", lora_name=None)
    assert (second.block_hashes, second.parent_block_hash) == ([h[2]], h[1])
    assert removed == V033.BlockRemoved(block_hashes=[h[2]], medium="GPU")
    assert isinstance(cleared, V033.AllBlocksCleared)
    # fields at their default are left out, as vLLM's omit_defaults does
    raw = msgpack.unpackb(encode_batch(events, 4))
    assert raw[1][0].keys() == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                "lora_id", "medium", "lora_name"}
    assert raw[1][3] == {"type": "AllBlocksCleared"} and len(raw) == 2


def test_each_format_decodes_only_with_its_release_structs():
    """vLLM 0.33 rejects the array events of 0.11 (kvpool's payload before this format), and back."""
    _, events = pool_events()
    for fmt, own in FORMAT_STRUCTS.items():
        payload = encode_batch(events, 4, fmt)
        assert len(msgspec.msgpack.decode(payload, type=own.KVEventBatch).events) == 4
        other = V011 if own is V033 else V033
        with pytest.raises(msgspec.ValidationError, match=r"Expected `(object|array)`, got `(array|object)`"):
            msgspec.msgpack.decode(payload, type=other.KVEventBatch)
        batch = decode_batch(payload)  # kvpool's own reader (`kvpool events`) takes both
        assert batch.format == fmt and [e["type"] for e in batch.events] == [
            "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert batch.events == decode_batch(encode_batch(events, 4)).events


def _fields(struct: type) -> list[tuple]:
    """(name, type without module paths, default) of each field."""
    return [(f.name, re.sub(r"[\w.<>]+\.(?=\w)", "", str(f.type)), f.default) for f in msgspec.structs.fields(struct)]


def test_vllm_0_33_own_struct_classes_decode_the_default_format():
    """The struct classes of the vLLM 0.33.0 wheel itself (its class statements, run unmodified)."""
    sources = vllm_sources("0.33.0")
    if sources is None:
        pytest.skip("pip could not fetch vllm==0.33.0 (no package index); the declared structs still ran")
    real = load_vllm_structs(*sources)
    h, events = pool_events()
    batch = msgspec.msgpack.decode(encode_batch(events, 4, ts=1.0), type=real.KVEventBatch)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                        "AllBlocksCleared"]
    assert batch.events[1].block_hashes == [h[2]] and batch.events[1].parent_block_hash == h[1]
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"):  # the declared copies agree
        ours, theirs = getattr(V033, name), getattr(real, name)
        assert _fields(ours) == _fields(theirs), name
        for opt in ("array_like", "omit_defaults", "tag"):
            assert getattr(ours.__struct_config__, opt) == getattr(theirs.__struct_config__, opt), (name, opt)
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        msgspec.msgpack.decode(encode_batch(events, 4, "vllm-0.11"), type=real.KVEventBatch)


@pytest.mark.parametrize("batch, match", [
    ({"ts": 1}, "expected \\[ts, events\\]"),
    ([1.0, [["BlockStored", []]]], "not a vllm-0.11 KV event"),
    ([1.0, [{"type": "AllBlocksCleared"}, ["AllBlocksCleared"]]], "mixes array"),
    ([1.0, [{"block_hashes": []}]], "a map with a 'type'"),
    ([1.0, [7]], "a map with a 'type'"),
])
def test_decode_refuses_what_no_publisher_sends(batch, match):
    with pytest.raises(ValueError, match=match):
        decode_batch(msgpack.packb(batch))


def test_encoding_in_the_older_vllm_0_11_format():
    h = hash_blocks(list(range(8)), 4)
    enc = encode_events([BlockStored(h, None), BlockRemoved([h[1]]), AllBlocksCleared()], 4, "vllm-0.11")
    assert enc == [["BlockStored", h, None, [], 4, None, "GPU"], ["BlockRemoved", [h[1]], "GPU"], ["AllBlocksCleared"]]
    with pytest.raises(ValueError, match="events_format must be one of vllm-0.33, vllm-0.11"):
        encode_events([], 4, "vllm-0.20")


@pytest.mark.parametrize("fmt", ["vllm-0.33", "vllm-0.11"])
def test_subscriber_rebuilds_cached_set_and_replay(tmp_path, fmt):
    ctx = zmq.Context()
    pub_ep, replay_ep = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = EventPublisher(ctx, pub_ep, replay_ep, fmt=fmt)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_ep)
    time.sleep(0.3)  # slow joiner
    pool = Pool(9, 4, enable_events=True)
    for i in range(12):  # churn: allocations evict older cached chains
        tokens = [i % 5] * 4 + list(range(100 * i, 100 * i + 8))
        pool.allocate(i, hash_blocks(tokens, 4), len(tokens), len(tokens))
        if i % 2:
            pool.free(i - 1)
            pool.free(i)
        if i == 6:
            pool.reset_prefix_cache() or None
        publisher.publish("pool-a", pool.take_events(), 4)
    pool.evict(100)
    publisher.publish("pool-a", pool.take_events(), 4)
    seen, cached, last = [], CachedView(), -1
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"pool-a"
        seq = int.from_bytes(seq, "big")
        assert seq == last + 1
        last = seq
        msgspec.msgpack.decode(payload, type=FORMAT_STRUCTS[fmt].KVEventBatch)  # as vLLM's subscribers do
        cached.apply(decode_batch(payload).events)
        seen.append(payload)
        if seq == publisher.next_seq - 1:
            break
    assert cached.hashes() == set(pool.blocks.cached), "events alone rebuild the manager's cached set"
    # replay from seq 3 on
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    dealer.send_multipart([b"", (3).to_bytes(8, "big")])  # as a REQ socket frames it (vLLM's subscribers)
    got, ends = [], []
    for _ in range(200):
        if publisher.replay.poll(10) or publisher.replay_pending:
            publisher.serve_replay()
        if dealer.poll(10):
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[-2], "big")
            if seq == END_SEQ:
                ends.append(frames)
                break
            # vLLM 0.33.0 replies [topic, seq, payload]; 0.11.0 replied [seq, payload]
            assert frames[:-2] == ([b"", b"pool-a"] if fmt == "vllm-0.33" else [b""])
            got.append((seq, frames[-1]))
    assert ends == [[b"", b"", b"\xff" * 8, b""] if fmt == "vllm-0.33" else [b"", b"\xff" * 8, b""]]
    assert [s for s, _ in got] == list(range(3, publisher.next_seq))
    assert [p for _, p in got] == seen[3:]
    assert isinstance(msgpack.unpackb(got[0][1])[0], float)
    publisher.close()
    sub.close(0)
    dealer.close(0)
    ctx.term()


def test_a_multi_shard_pool_losing_a_shard_publishes_its_clear_and_the_loop_survives(tmp_path):
    from kvpool.manager.config import ManagerConfig
    from kvpool.manager.server import Server
    from kvpool.shared.protocol import encode_request, unpack

    srv = Server(ManagerConfig(endpoint=f"ipc://{tmp_path}/m.sock", events_endpoint=f"ipc://{tmp_path}/ev.sock"))
    srv.bind()
    sub = srv.ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/ev.sock")
        time.sleep(0.3)  # slow joiner

        def call(op, sid=None, **args):
            reply = unpack(srv.handle_payload(encode_request(1, op, sid, args), time.monotonic()))
            assert reply["status"] == "ok", reply
            return reply["body"]

        spec = {"block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
        sids = [call("hello")["sid"] for _ in range(2)]
        for rank, sid in enumerate(sids):
            call("register", sid, pool="p", shard_rank=rank, shard_count=2, incarnation=f"i{rank}", spec=spec,
                 available_kv_bytes=1 << 16)
        call("deregister", sids[1])
        srv.run_once(0)  # was: AttributeError on the dropped Pool's block size, killing the loop
        assert sub.poll(2000)
        topic, _, payload = sub.recv_multipart()
        assert topic == b"p" and decode_batch(payload).events == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(0)
        srv.close()


@pytest.mark.parametrize("fmt", ["vllm-0.33", "vllm-0.11"])
def test_kvpool_events_names_the_format_of_each_batch(capsys, fmt):
    from kvpool.cli.tools import _print_batch
    from kvpool.manager.event_client import read_batch

    h, events = pool_events()
    _print_batch(read_batch("pool-a", 3, encode_batch(events, 4, fmt)), as_json=False)
    line = capsys.readouterr().out
    assert f"#3 pool-a [{fmt}]: stored 2 [{h[0].hex()[:8]}..] parent -, stored 1" in line
    assert line.rstrip().endswith("removed 1 [" + h[2].hex()[:8] + "..], AllBlocksCleared")
    _print_batch(read_batch("pool-a", 4, msgpack.packb([1.0, [7]])), as_json=False)
    assert "undecodable batch" in capsys.readouterr().err


class _CountingSocket:
    """A socket that counts the messages sent through it (everything else passes through)."""

    def __init__(self, sock):
        self.sock, self.sent = sock, 0

    def send_multipart(self, frames, *args, **kw):
        self.sock.send_multipart(frames, *args, **kw)
        self.sent += 1

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_replay_never_holds_the_loop_and_a_burst_of_requests_is_rate_limited(tmp_path):
    ctx = zmq.Context()
    publisher = EventPublisher(ctx, f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock",
                               replay_budget=50, replay_rate=5.0, max_replays=16)
    for _ in range(300):
        publisher.publish("p", [AllBlocksCleared()], 4)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/replay.sock")
    for _ in range(40):  # a burst: 5 fit the bucket, the other 35 get the end marker alone
        dealer.send((0).to_bytes(8, "big"))
    while not publisher.replay.poll(100):
        pass
    time.sleep(0.2)  # let the whole burst arrive
    # counted where the publisher sends, not where the dealer receives: on a loaded machine one
    # call's messages can arrive after the next call's, and a count at the receiver mixes them
    sends = _CountingSocket(publisher.replay)
    publisher.replay = sends
    per_call = []
    received: list[int] = []
    for _ in range(200):
        before = sends.sent
        publisher.serve_replay()
        per_call.append(sends.sent - before)
        while dealer.poll(20):
            received.append(int.from_bytes(dealer.recv_multipart()[-2], "big"))  # [topic,] seq, payload
        if not publisher.replays and not publisher.replay.poll(0):
            break
    while len(received) < 5 * 300 + 40 and dealer.poll(5000):
        received.append(int.from_bytes(dealer.recv_multipart()[-2], "big"))
    batches = [s for s in received if s != END_SEQ]
    assert max(per_call) <= 50 + 40, "one call sends at most replay_budget batches (+ end markers)"
    assert len(batches) == 5 * 300 and received.count(END_SEQ) == 40
    assert publisher.replays_refused == 35
    assert sorted(batches) == sorted(list(range(300)) * 5), "each admitted replay got every batch"
    publisher.close()
    dealer.close(0)
    ctx.term()


def _tiers(view: CachedView) -> dict[str, set]:
    return {medium: view.hashes(medium) for medium in TIER_MEDIUM.values()}


def _receive_until(sub, view: CachedView, want: dict[str, set]) -> None:
    while _tiers(view) != want and sub.poll(3000):
        _, _, payload = sub.recv_multipart()
        view.apply(decode_batch(payload).events)


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["demote", "write_through"])
def test_a_restarted_manager_restates_both_tiers_to_a_subscriber(tmp_path, policy):
    """The host map is journaled: after a restart a subscriber ends with the recovered view of
    both tiers (host hashes stored again with medium CPU after the clear), as the manager has it;
    under write-through those include the copies of blocks still on the device."""
    from helpers.durable import (
        REDIS_URL,
        call,
        drop_namespace,
        durable_server,
        new_namespace,
        redis_or_skip,
    )
    from helpers.manager import SPEC, kv_bytes, ok

    r, name = redis_or_skip(), new_namespace()
    ev_ep, replay_ep = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    cfg = dict(endpoint=f"ipc://{tmp_path}/m.sock", events_endpoint=ev_ep, events_replay_endpoint=replay_ep,
               redis_url=REDIS_URL, namespace=name, lease_ms=1000, redis_timeout_s=0.5)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ev_ep)
    view = CachedView()  # a two-tier subscriber: each medium's cached set
    servers = []

    def tiers_of(srv) -> dict[str, set]:
        pool = srv.registry.pools["p"].pool
        return {"GPU": set(pool.blocks.cached), "CPU": set(pool.host.blocks.cached)}

    try:
        first = durable_server(**cfg)
        servers.append(first)
        first.bind()
        time.sleep(0.3)  # slow joiner
        sid = ok(call(first, "hello"))["sid"]
        ok(call(first, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                available_kv_bytes=kv_bytes(6), host_kv_bytes=kv_bytes(8), host_kv_policy=policy))
        for i in range(4):  # each chain fills the device: the one before is demoted to the host tier
            toks = [1000 * i + t for t in range(17)]
            ops = [{"op": "alloc", "req": i, "hashes": hash_blocks(toks, 4), "prompt_len": 17, "max_new": 17}]
            ok(call(first, "step", sid, pool="p", epoch=1, ops=ops))
            ok(call(first, "step", sid, pool="p", epoch=1, ops=[{"op": "free", "req": i}]))
            first.run_once(0)  # commits and publishes
        before = tiers_of(first)
        assert len(before["CPU"]) == 7 and len(before["GPU"]) == 4
        # demote: the last chain is on the device only; write-through: also on the host
        assert (before["GPU"] <= before["CPU"]) is (policy == "write_through")
        _receive_until(sub, view, before)
        assert _tiers(view) == before
        first.close()
        servers.remove(first)
        view.apply([{"type": "BlockStored", "block_hashes": [b"x" * 32], "medium": "CPU"}])  # the subscriber may hold anything stale: the restatement clears it
        second = durable_server(**cfg)
        servers.append(second)
        second.bind()
        second.run_once(0)  # the restatement: published in the first iteration, kept for replay
        after = tiers_of(second)
        assert after == before
        # A reconnecting SUB socket misses what a new publisher sends before it joined (ZeroMQ's
        # slow joiner); a subscriber that sees the sequence start over asks the replay from 0.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        for _ in range(500):
            second.run_once(10)
            if dealer.poll(0):
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big")
                if seq == END_SEQ:
                    break
                seqs.append(seq)
                view.apply(decode_batch(frames[-1]).events)
        dealer.close(0)
        assert seqs == [0] and _tiers(view) == after
    finally:
        for srv in servers:
            srv.close()
        sub.close(0)
        ctx.term()
        drop_namespace(r, name)
        r.close()
