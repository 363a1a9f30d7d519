"""The node tier's ops for an engine that owns its device blocks (vLLM's connector), through the
manager's ``handle_payload`` (no sockets): ``node_join``, ``node_lookup``, ``node_load``,
``node_save`` and ``node_done`` with a ``layout``. A save lands only once reported; a load names
positions, holds its slots until reported; a failed order drops its hash; bad input changes
nothing; an ended session abandons its batches; a kvpool pool and an engine of one layout share."""

from __future__ import annotations

import pytest
from helpers.kv_spec import SPEC
from helpers.manager import call, hello, kv_bytes, make_server, ok

from kvpool.manager.state.mutations import (
    EngineFinished,
    EngineLoaded,
    EngineSaved,
    NodeJoined,
    from_wire,
    to_wire,
)
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_tier import layout_id
from kvpool.shared.protocol import KVSpec

MODEL = "vllm:tiny"


@pytest.fixture
def srv(tmp_path):
    return make_server(node_tier_memory=64 * 1024, node_tier_dir=str(tmp_path), node_tier_disk=str(tmp_path / "d"),
                       node_tier_disk_size=128 * 1024)


def engine(srv) -> tuple[str, str]:
    sid = hello(srv)
    info = ok(call(srv, "node_join", sid, spec=SPEC, node_model=MODEL))["node_tier"]
    return sid, info["layout"]


def chain(n: int = 4, first: int = 100) -> list[bytes]:
    return hash_blocks(list(range(first, first + 4 * n + 1)), 4)


def save(srv, sid, layout, batch, blocks, hashes) -> list[dict]:
    parents = [None, *hashes[:-1]]
    return ok(call(srv, "node_save", sid, layout=layout, batch=batch, blocks=blocks, hashes=hashes,
                   parents=parents))["orders"]


def lookup(srv, sid, layout, hashes) -> int:
    return ok(call(srv, "node_lookup", sid, layout=layout, hashes=hashes))["blocks"]


def test_a_save_lands_once_reported_and_another_engine_loads_it_by_position(srv):
    a, layout = engine(srv)
    assert layout == layout_id(KVSpec.from_wire(SPEC), MODEL).hex()
    b, layout_b = engine(srv)
    assert layout_b == layout
    hashes = chain()
    orders = save(srv, a, layout, 1, [5, 6, 7, 8], hashes)
    assert [(o["op"], o["level"], o["src"], o["key"]) for o in orders] == [
        ("save", "host", blk, h) for blk, h in zip([5, 6, 7, 8], hashes)]
    assert lookup(srv, b, layout, hashes) == 0  # landing: nothing readable before the report
    assert ok(call(srv, "node_done", a, layout=layout, reports=[{"batch": 1}]))["finished"] == 1
    assert lookup(srv, b, layout, hashes) == 4
    # the hashes after those the engine holds itself: each chained hash names its whole prefix
    assert lookup(srv, b, layout, hashes[1:]) == 3
    got = ok(call(srv, "node_load", b, layout=layout, batch=1, hashes=hashes))
    assert got["blocks"] == 4
    assert [(o["op"], o["level"], o["src"], o["dst"], o["key"]) for o in got["orders"]] == [
        ("load", "host", o["dst"], pos, o["key"]) for pos, o in enumerate(orders, start=1)]
    # a second save of the same hashes is skipped: the tier holds them
    assert save(srv, b, layout, 2, [9, 10, 11, 12], hashes) == []


def test_a_failed_load_drops_its_hash_and_the_run_stops_there(srv):
    a, layout = engine(srv)
    hashes = chain()
    save(srv, a, layout, 1, [1, 2, 3, 4], hashes)
    call(srv, "node_done", a, layout=layout, reports=[{"batch": 1}])
    got = ok(call(srv, "node_load", a, layout=layout, batch=2, hashes=hashes))
    failed = got["orders"][2]  # position 3 did not verify
    ok(call(srv, "node_done", a, layout=layout, reports=[{"batch": 2, "failed": [failed]}]))
    assert lookup(srv, a, layout, hashes) == 2
    stats = ok(call(srv, "stats", a))["manager"]["node_tiers"][layout]
    assert stats["host"]["verify_failures"] == 1 and stats["batches"] == 0


def test_bad_input_is_refused_by_name_and_changes_nothing(srv):
    a, layout = engine(srv)
    hashes = chain()
    assert call(srv, "node_lookup", a, layout="0123456789abcdef", hashes=hashes)["status"] == "unknown_layout"
    assert call(srv, "node_save", a, layout=layout, batch=1, blocks=[1, 2], hashes=hashes,
                parents=[None] * 4)["status"] == "bad_field"
    assert call(srv, "node_save", a, layout=layout, batch=1, blocks=[0, 1, 2, 3], hashes=hashes,
                parents=[None] * 4)["status"] == "bad_field"  # engine block 0 is vLLM's null block
    assert call(srv, "node_join", a, spec={**SPEC, "dtype": "int8"}, node_model=MODEL)["status"] == "bad_field"
    save(srv, a, layout, 1, [1, 2, 3, 4], hashes)
    assert call(srv, "node_save", a, layout=layout, batch=1, blocks=[5], hashes=chain(1, 900),
                parents=[None])["status"] == "bad_field"  # batch 1 is still open
    foreign = {"op": "load", "level": "host", "src": 3, "dst": 1, "key": hashes[0]}
    reply = call(srv, "node_done", a, layout=layout, reports=[{"batch": 1}, {"batch": 1, "failed": [foreign]}])
    assert reply["status"] == "bad_field"
    assert lookup(srv, a, layout, hashes) == 0  # batch 1 not finished by the refused report
    assert ok(call(srv, "node_done", a, layout=layout, reports=[{"batch": 1}]))["finished"] == 1
    assert lookup(srv, a, layout, hashes) == 4


def test_a_manager_without_a_node_tier_says_so(tmp_path):
    srv = make_server()
    sid = hello(srv)
    reply = call(srv, "node_join", sid, spec=SPEC, node_model=MODEL)
    assert reply["status"] == "no_node_tier" and "--node-tier-memory" in reply["msg"]


def test_an_ended_session_abandons_its_batches(srv):
    a, layout = engine(srv)
    hashes = chain()
    save(srv, a, layout, 1, [1, 2, 3, 4], hashes)
    ok(call(srv, "deregister", a))
    b, _ = engine(srv)
    assert lookup(srv, b, layout, hashes) == 0
    assert save(srv, b, layout, 1, [1, 2, 3, 4], hashes) != []  # the abandoned slots lost their hashes


def test_a_pool_and_an_engine_of_one_layout_share_the_tier(srv):
    """An engine in front of the tier makes a pool beside it save what it computes at once (a
    pool alone only moves blocks down as its own tiers hand them out); once the engine's session
    ends the pool is alone again."""
    e, layout = engine(srv)
    sid = hello(srv)
    body = ok(call(srv, "register", sid, pool="p", shard_rank=0, shard_count=1, incarnation="p", spec=SPEC,
                   available_kv_bytes=kv_bytes(16), node_model=MODEL))
    assert layout == body["node_tier"]["layout"]
    hashes = chain()
    res = ok(call(srv, "step", sid, pool="p", epoch=body["epoch"], ops=[
        {"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 17, "max_new": 17}]))["results"][0]
    ok(call(srv, "node_done", sid, pool="p", reports=[{"batch": res["node"]["batch"]}]))
    assert lookup(srv, e, layout, hashes) == 4
    ok(call(srv, "deregister", e))
    res = ok(call(srv, "step", sid, pool="p", epoch=body["epoch"], ops=[
        {"op": "alloc", "req": 2, "hashes": chain(first=300), "prompt_len": 17, "max_new": 17}]))["results"][0]
    assert "node" not in res  # alone on the tier again: nothing saved eagerly


def test_the_engine_records_round_trip_through_the_journal_codec():
    h = chain(2)
    for rec in (NodeJoined("s", SPEC, MODEL, 0, 1), NodeJoined("s", SPEC, MODEL, 1, 2, [1 << 20, "/dev/shm", None, 0, "demote", None, 0.5, 4]), EngineLoaded("s", "ab" * 8, 3, h, -1),
                EngineSaved("s", "ab" * 8, 4, [7, 8], h, [None, h[0]], 0),
                EngineFinished("s", "ab" * 8, 4, [{"op": "save", "level": "host", "src": 7, "dst": 2, "key": h[0]}])):
        assert from_wire(to_wire(rec)) == rec
