"""The connector's scheduler half (kvpool/integrations/vllm/scheduler.py) against a real manager
with a node tier, fed the attributes vLLM 0.32.0/0.33.0's ``Request`` and ``SchedulerOutput``
carry: a server's computed blocks are saved and another server's lookup finds them (never the
last token's block); its allocation holds them as positions in its own table; a step that went
back (a failed load recomputed) saves those blocks again; a manager that is gone answers
"nothing" at once and is joined again once back."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from kvpool.integrations.vllm.link import ManagerLink
from kvpool.integrations.vllm.records import ConnectorSettings, NodeStepReport
from kvpool.integrations.vllm.scheduler import KvpoolScheduler
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_orders import Load, Save
from kvpool.shared.protocol import KVSpec

BS = 4
SPEC = KVSpec(block_size=BS, num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
TOKENS = list(range(500, 518))  # 4 full blocks and 2 tokens


def request(req_id: str, tokens=TOKENS, salt=None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens), num_tokens=len(tokens), cache_salt=salt,
                           lora_request=None, priority=0, mm_features=[], prompt_embeds=None)


def new_step(req_id: str, blocks: list[int], computed: int, scheduled: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: scheduled})


def cached_step(req_id: str, computed: int, scheduled: int) -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[computed])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: scheduled})


def scheduler(endpoint: str, **kw) -> KvpoolScheduler:
    return KvpoolScheduler(ManagerLink(endpoint, SPEC.to_wire(), "vllm:test", **kw), BS)


def run_saves(s: KvpoolScheduler, plan) -> list[Save]:
    """What a worker does with the plan's saves: all of them land."""
    s.reported(NodeStepReport([{"batch": plan.save.batch}]))
    return plan.save.orders


def test_one_servers_saves_are_found_and_held_by_another(live_server, tmp_path):
    m = live_server(node_tier_memory=1 << 20, node_tier_dir=str(tmp_path))
    a, b = scheduler(m.endpoint), scheduler(m.endpoint)
    req = request("r1")
    assert a.lookup(req, 0) == 0
    saves = run_saves(a, a.plan(new_step("r1", [11, 12, 13, 14, 15], 0, 18)))
    hashes = hash_blocks(TOKENS, BS)
    assert [(o.src, o.key) for o in saves] == list(zip([11, 12, 13, 14], hashes))
    assert a.plan(cached_step("r1", 18, 1)).save is None  # nothing new is full: nothing to save
    req_b = request("x")
    assert b.lookup(req_b, 0) == 4 * BS
    assert b.lookup(request("y", TOKENS[:16]), 0) == 3 * BS  # the last token's block is computed
    assert b.lookup(req_b, 2 * BS) == 2 * BS  # after the blocks vLLM holds itself
    assert b.lookup(request("z", salt="tenant"), 0) == 0  # another tenant's chain
    image = request("i")
    image.mm_features = [object()]
    assert b.lookup(image, 0) == 0  # an image's placeholder tokens are not its key: never loaded
    assert b.plan(new_step("i", [31, 32, 33, 34, 35], 0, 18)).save is None  # nor saved
    b.lookup(req_b, BS)
    b.allocated(req_b, [21, 22, 23, 24, 25], 3 * BS)
    (job,) = b.plan(new_step("x", [21, 22, 23, 24, 25], 4 * BS, 2)).loads
    assert job.blocks == [22, 23, 24] and job.missing == [] and job.first_index == 1
    assert [(type(o), o.dst, o.key) for o in job.orders] == [(Load, i + 1, h) for i, h in enumerate(hashes[1:])]


def test_a_step_that_went_back_saves_its_blocks_again(live_server, tmp_path):
    m = live_server(node_tier_memory=1 << 20, node_tier_dir=str(tmp_path))
    a = scheduler(m.endpoint)
    a.lookup(request("r"), 0)
    run_saves(a, a.plan(new_step("r", [1, 2, 3, 4, 5], 0, 18)))
    # vLLM recomputes from block 1 (a load there failed): blocks 1..3 fill again in this step; the
    # tier holds their hashes already, so nothing is ordered, but they are asked for again
    before = a.stats.save_blocks
    plan = a.plan(cached_step("r", BS, 14))
    assert a.stats.save_blocks - before == 3 and plan.save.orders == []


def test_a_missing_manager_costs_one_timeout_then_nothing_until_it_is_back(live_server, sock_dir, tmp_path):
    endpoint = f"ipc://{sock_dir}/m0.sock"  # where live_server's first manager binds (started below)
    s = scheduler(endpoint, timeout_s=0.3, retry_s=1.0)
    req = request("r")
    assert s.lookup(req, 0) == 0 and s.link.stats.failures == 1
    t = time.monotonic()
    assert s.lookup(req, 0) == 0 and time.monotonic() - t < 0.1  # resting: no call at all
    s.allocated(req, [1, 2, 3, 4, 5], 2 * BS)  # vLLM had a hit from before: it is a load error now
    (job,) = s.plan(new_step("r", [1, 2, 3, 4, 5], 2 * BS, 10)).loads
    assert job.batch is None and job.missing == [1, 2]
    m = live_server(node_tier_memory=1 << 20, node_tier_dir=str(tmp_path))
    time.sleep(1.1)
    assert m.endpoint == endpoint and s.lookup(req, 0) == 0 and s.link.info is not None  # joined


def test_the_extra_config_is_checked_with_what_to_write():
    assert ConnectorSettings.from_extra({"manager": "ipc:///tmp/m.sock", "timeout_s": 1}).timeout_s == 1
    for extra, says in (({}, '"manager": the kvpool manager'), ({"manager": "localhost:5555"}, "tcp://HOST:PORT"),
                        ({"manager": "ipc:///m", "retry": 3}, "unknown keys ['retry']"),
                        ({"manager": "ipc:///m", "timeout_s": 0}, "seconds in (0, 3600]")):
        with pytest.raises(ValueError, match=re.escape(says)):
            ConnectorSettings.from_extra(extra)
