"""The node tier's KV events (no sockets: ``handle_payload`` and the loop's commit into a sink
that encodes each batch as the ZeroMQ publisher does): blocks stored to and removed from each
level go out on the tier's own topic, ``node/LAYOUT``, in vLLM 0.33's format with the medium
naming the level ("CPU": its shared host memory, "DISK"), decoded here with vLLM's structs; a
level's reset is a removal of its hashes; why each block left is counted in stats; a recovered
tier restates itself."""

from __future__ import annotations

import msgspec
import pytest
from helpers.kv_spec import SPEC
from helpers.manager import call, hello, kv_bytes, ok
from helpers.vllm_structs import V033

from kvpool.manager.config import ManagerConfig
from kvpool.manager.events import encode_batch
from kvpool.manager.server import Server
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_tier import node_topic

MODEL = "preset:test:seed=0"


class Capture:
    """The loop's event sink, encoding each batch with the block size the publisher would use."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, bytes]] = []
        self.block_size = None

    def publish(self, topic: str, epoch: int, events: list) -> None:
        self.batches.append((topic, encode_batch(events, self.block_size(topic))))

    def close(self) -> None:
        pass

    def take(self, topic: str) -> list:
        """Every event published on ``topic`` since the last call, decoded with vLLM 0.33's structs."""
        out = [e for t, p in self.batches if t == topic for e in msgspec.msgpack.decode(p, type=V033.KVEventBatch).events]
        self.batches = [(t, p) for t, p in self.batches if t != topic]
        return out


@pytest.fixture
def srv(tmp_path):
    sink = Capture()
    s = Server(ManagerConfig(endpoint="ipc:///tmp/kvpool-unused.sock", node_tier_memory=8 * 576,
                             node_tier_dir=str(tmp_path), node_tier_disk=str(tmp_path / "d"),
                             node_tier_disk_size=64 * 1024, node_tier_policy="write_through"), publisher=sink)
    sink.block_size = s.hooks.block_size
    s.sink = sink
    sid = hello(s)  # an idle second pool of the layout: the tier is shared, so blocks are saved as computed
    ok(call(s, "register", sid, pool="z", shard_rank=0, shard_count=1, incarnation="z", spec=SPEC,
            available_kv_bytes=kv_bytes(16), node_model=MODEL))
    return s


def test_blocks_stored_and_removed_by_level_go_out_on_the_tiers_topic(srv):
    sink = srv.sink
    sid = hello(srv)
    body = ok(call(srv, "register", sid, pool="a", shard_rank=0, shard_count=1, incarnation="a", spec=SPEC,
                   available_kv_bytes=kv_bytes(16), node_model=MODEL))
    topic = node_topic(body["node_tier"]["layout"])
    hashes = hash_blocks(list(range(100, 113)), 4)  # 3 full blocks
    (res,) = ok(call(srv, "step", sid, pool="a", epoch=1, ops=[
        {"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 13, "max_new": 13}]))["results"]
    ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": res["node"]["batch"]}]))
    srv._commit([])
    stored = sink.take(topic)
    assert [(type(e).__name__, e.medium, e.block_size) for e in stored] == (
        [("BlockStored", "CPU", 4)] * 3 + [("BlockStored", "DISK", 4)] * 3)  # level by level
    assert [e.block_hashes for e in stored[:3]] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in stored[:3]] == [None, hashes[0], hashes[1]]
    assert [e.block_hashes for e in stored[3:]] == [[h] for h in hashes]
    assert all(e.token_ids == [] and e.lora_id is None for e in stored)

    admin = hello(srv, role="admin")
    assert ok(call(srv, "evict", admin, pool="a", n=1, tier="node_host"))["evicted"] == 1
    assert ok(call(srv, "reset_cache", admin, pool="a", tier="node_disk"))["reset"]
    srv._commit([])
    removed = sink.take(topic)
    assert removed == [V033.BlockRemoved(block_hashes=[hashes[0]], medium="CPU"),  # LRU first
                       V033.BlockRemoved(block_hashes=sorted(hashes, key=hashes.index), medium="DISK")]
    (usage,) = ok(call(srv, "stats", admin))["manager"]["node_tiers"].values()
    assert usage["host"]["removed"]["demoted"] == 1 and usage["disk"]["removed"]["cleared"] == 3
    device = sink.take("a")  # the pool's own topic carries the device's events only
    assert device and {getattr(e, "medium", "GPU") for e in device} == {"GPU"} and sink.batches == []


def test_a_recovered_tier_restates_itself_on_its_topic(srv, tmp_path):
    """A recovered manager's subscribers learn the tier's whole index again: one AllBlocksCleared,
    then every hash of each level (as a recovered pool restates its own)."""
    from kvpool.manager.registry import Registry
    from kvpool.manager.store.state_file import dump_registry, load_registry

    sid = hello(srv)
    body = ok(call(srv, "register", sid, pool="a", shard_rank=0, shard_count=1, incarnation="a", spec=SPEC,
                   available_kv_bytes=kv_bytes(16), node_model=MODEL))
    topic = node_topic(body["node_tier"]["layout"])
    hashes = hash_blocks(list(range(100, 109)), 4)
    (res,) = ok(call(srv, "step", sid, pool="a", epoch=1, ops=[
        {"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 9, "max_new": 9}]))["results"]
    ok(call(srv, "node_done", sid, pool="a", reports=[{"batch": res["node"]["batch"]}]))
    srv._commit([])
    sink = srv.sink
    sink.take(topic)
    fresh = Registry("r", session_timeout_s=10.0)
    load_registry(dump_registry(srv.registry, 0), fresh, 0.0)
    srv.registry.adopt(fresh)
    srv._commit([])
    events = sink.take(topic)
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
    assert [(sorted(e.block_hashes), e.medium) for e in events[1:]] == [(sorted(hashes), "CPU"),
                                                                        (sorted(hashes), "DISK")]
