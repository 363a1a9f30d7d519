import time

import msgpack
import zmq
from helpers.manager import apply

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.manager.core.pool import Pool
from kvpool.manager.events import END_SEQ, EventPublisher, decode_batch, encode_events
from kvpool.shared.hashing import hash_blocks


def test_encoding_is_vllm_array_like_tagged():
    h = hash_blocks(list(range(8)), 4)
    enc = encode_events([BlockStored(h, None), BlockRemoved([h[1]]), AllBlocksCleared()], 4)
    assert enc == [["BlockStored", h, None, [], 4, None, "GPU"], ["BlockRemoved", [h[1]], "GPU"], ["AllBlocksCleared"]]


def test_subscriber_rebuilds_cached_set_and_replay(tmp_path):
    ctx = zmq.Context()
    pub_ep, replay_ep = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = EventPublisher(ctx, pub_ep, replay_ep)
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
    seen, cached, last = [], set(), -1
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"pool-a"
        seq = int.from_bytes(seq, "big")
        assert seq == last + 1
        last = seq
        apply(cached, decode_batch(payload)[1])
        seen.append(payload)
        if seq == publisher.next_seq - 1:
            break
    assert cached == set(pool.blocks.cached), "events alone rebuild the manager's cached set"
    # replay from seq 3 on
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    dealer.send_multipart([b"", (3).to_bytes(8, "big")])
    got = []
    for _ in range(200):
        if publisher.replay.poll(10) or publisher.replay_pending:
            publisher.serve_replay()
        if dealer.poll(10):
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[-2], "big")
            if seq == END_SEQ:
                break
            got.append((seq, frames[-1]))
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
        assert topic == b"p" and decode_batch(payload)[1] == [["AllBlocksCleared"]]
    finally:
        sub.close(0)
        srv.close()


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
    per_call = []
    received: list[int] = []
    for _ in range(200):
        publisher.serve_replay()
        n = 0
        while dealer.poll(20):
            received.append(int.from_bytes(dealer.recv_multipart()[0], "big"))
            n += 1
        per_call.append(n)
        if not publisher.replays and not publisher.replay.poll(0):
            break
    batches = [s for s in received if s != END_SEQ]
    assert max(per_call) <= 50 + 40, "one call sends at most replay_budget batches (+ end markers)"
    assert len(batches) == 5 * 300 and received.count(END_SEQ) == 40
    assert publisher.replays_refused == 35
    assert sorted(batches) == sorted(list(range(300)) * 5), "each admitted replay got every batch"
    publisher.close()
    dealer.close(0)
    ctx.term()
