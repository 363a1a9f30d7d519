"""Tensor parallelism in one process: ranks as threads (helpers.tp), exact comparisons with the
single-shard worker; the command channel's framing; the registry losing a shard. Real processes
over gloo and a manager daemon: test_tensor_parallel_procs.py."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.tp import TPPair, rank_kv_bytes, sharded_models
from helpers.worker import (
    BLOCK_BYTES,
    TINY,
    assert_drained,
    evict_with_others,
    greedy,
    make_engine,
    make_prompt,
    reference,
    run_dry,
)

from kvpool.manager.registry import Registry
from kvpool.shared.protocol import KVSpec, ManagerError
from kvpool.worker import tp as tp_module
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.engine import Engine
from kvpool.worker.kv_cache import allocate_kv_caches, kv_spec
from kvpool.worker.model import build_model
from kvpool.worker.parallel import TPPeerLost, check_tp
from kvpool.worker.runner import ModelRunner
from kvpool.worker.step_plan import Batch, BatchSeq
from kvpool.worker.tp import HEAD, Channel, TPLeader, decode_plan, encode_plan

# -- sharding ---------------------------------------------------------------------------------


def test_each_rank_keeps_its_slice_of_every_projection():
    full = build_model(TINY, torch.float32, "cpu", seed=0)
    r1 = sharded_models(2)[1]
    a, fa = r1.model.layers[1].self_attn, full.model.layers[1].self_attn
    assert (a.num_heads, a.num_kv_heads, r1.local_kv_heads, r1.tp_rank) == (2, 1, 1, 1)
    assert torch.equal(a.q_proj.weight, fa.q_proj.weight[32:64])  # heads 2, 3 of 16 dims
    assert torch.equal(a.k_proj.weight, fa.k_proj.weight[16:32])  # their KV head 1
    assert torch.equal(a.v_proj.weight, fa.v_proj.weight[16:32])
    assert torch.equal(a.o_proj.weight, fa.o_proj.weight[:, 32:64])
    m, fm = r1.model.layers[1].mlp, full.model.layers[1].mlp
    assert torch.equal(m.gate_proj.weight, fm.gate_proj.weight[64:])
    assert torch.equal(m.down_proj.weight, fm.down_proj.weight[:, 64:])
    assert torch.equal(r1.model.embed_tokens.weight, full.model.embed_tokens.weight)  # replicated
    assert a.q_proj.weight.is_contiguous() and a.o_proj.weight.is_contiguous()


def test_a_split_without_whole_heads_is_refused():
    with pytest.raises(ValueError, match=r"num_kv_heads 2 is not divisible by tp_size 4.*tp_size in \[1, 2\]"):
        check_tp(TINY, 4)
    check_tp(PRESETS["llama-3-8b"], 8)
    with pytest.raises(ValueError, match="tp_rank < tp_size"):
        WorkerConfig(tp_size=2, tp_rank=2)


def run_ranks(*fns):
    """Runs one function per rank on its own thread; their results in rank order."""
    out: list = [None] * len(fns)

    def call(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_two_shards_compute_the_logits_of_one():
    full = build_model(TINY, torch.float32, "cpu", seed=0)
    ranks = sharded_models(2)
    prompt = make_prompt(37, 1)
    plans = [Batch([BatchSeq(prompt[:20], 0, [3, 1], False), BatchSeq(prompt[:5], 0, [2], True)]),
             Batch([BatchSeq(prompt[20:], 20, [3, 1, 4], True)], copies=[(2, 5)])]

    def runner(model, kv_heads):
        caches = allocate_kv_caches(TINY.num_layers, 8, 16, kv_heads, TINY.head_size, torch.float32, "cpu")
        return ModelRunner(model, caches, 16)

    one = runner(full, 2)
    two = [runner(m, 1) for m in ranks]
    for plan in plans:
        want = one.execute(plan)
        got = run_ranks(lambda p=plan: two[0].execute(p), lambda p=plan: two[1].execute(p, sample=False))
        assert got[1] is None
        torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got[0].argmax(-1), want.argmax(-1))
    # each rank holds its KV head: the two slices side by side are the single shard's cache
    for layer in range(TINY.num_layers):
        torch.testing.assert_close(torch.cat([r.kv_caches[layer] for r in two], dim=3), one.kv_caches[layer],
                                   atol=1e-5, rtol=1e-5)


# -- rank 0's engine driving a follower ---------------------------------------------------------


def test_greedy_output_prefix_hits_and_forks_equal_one_shard():
    pair = TPPair()
    try:
        engine = pair.engine
        forwards = pair.count_forwards()
        system = make_prompt(48, 4)
        prompts = [system + make_prompt(5 + i, 10 + i) for i in range(3)] + [make_prompt(70, 5)]
        outs = engine.generate(prompts, greedy(10))
        assert engine.stats()["cached_tokens"] == 2 * 48  # the shared system prompt, hit twice
        single = make_engine()
        assert outs == single.generate(prompts, greedy(10))
        forked = engine.generate([make_prompt(37, 8)], greedy(6, n=3))  # copy-on-write copies on both ranks
        assert forked == single.generate([make_prompt(37, 8)], greedy(6, n=3))
        assert forked == [[reference(single, make_prompt(37, 8), 6)] * 3]
        pair.settle()
        assert pair.followers[0].steps == len(forwards) > 0  # every forward ran on both ranks
    finally:
        pair.close()


def test_an_arrival_joining_a_plan_late_runs_on_both_ranks_and_equals_one_shard():
    """A request that arrives while another runs joins the next plan by a message of its own
    (worker/step_loop.py ``_admit_late``): the follower runs the joined batch as rank 0 does."""
    pair = TPPair()
    try:
        engine = pair.engine
        forwards = pair.count_forwards()
        first, late = make_prompt(30, 1), make_prompt(40, 2)
        out: dict[str, list[int]] = {}
        ids = [engine.add_request(first, greedy(12))]
        for _ in range(3):
            engine.step()
        ids.append(engine.add_request(late, greedy(8)))
        run_dry(engine, out)
        assert engine.stats()["late_admissions"] == 1
        single = make_engine()
        assert out[ids[1]] == single.generate([late], greedy(8))[0][0]
        assert out[ids[0]] == single.generate([first], greedy(12))[0][0][-len(out[ids[0]]):]
        pair.settle()
        assert pair.followers[0].steps == len(forwards) > 0
    finally:
        pair.close()


def test_the_follower_applies_copy_on_write_to_its_slice():
    """After the fork step every sample's third block starts with the prompt's 5 tail tokens,
    on rank 1 as on rank 0 (the copy orders travel with the plan)."""
    pair = TPPair()
    try:
        engine, follower = pair.engine, pair.followers[0]
        engine.add_request(make_prompt(37, 8), greedy(4, n=3))
        engine.step()  # prefill; the children are forked at the next step
        parent = engine.scheduler.running[0]
        ranks = (engine.runner, follower.runner)
        original = [[c[:, parent.block_table[2], :5].clone() for c in r.kv_caches] for r in ranks]
        engine.step()  # fork + copy-on-write + decode
        pair.settle()
        tables = {r.block_table[2] for r in engine.scheduler.running}
        assert len(tables) == 3
        for runner, before in zip(ranks, original):
            for layer, cache in enumerate(runner.kv_caches):
                for b in tables:
                    assert torch.equal(cache[:, b, :5], before[layer])
    finally:
        pair.close()


def test_preemption_and_chunked_prefill_equal_one_shard():
    pair = TPPair(max_blocks=14, max_model_len=128, max_num_batched_tokens=32)
    try:
        prompts = [make_prompt(30 + i, 20 + i) for i in range(4)]
        outs = pair.engine.generate(prompts, greedy(60))
        assert pair.engine.stats()["preemptions"] > 0
        single = make_engine(max_blocks=14, max_model_len=128, max_num_batched_tokens=32)
        assert outs == single.generate(prompts, greedy(60))
        assert_drained(pair.engine)
    finally:
        pair.close()


def load_round_trip(pair: TPPair) -> None:
    """A prompt's first three blocks computed on both ranks, evicted from the device by others'
    work, then brought back by host-tier loads into other blocks: every rank's device blocks hold
    exactly the K/V slice that rank computed the first time."""
    engine, ranks = pair.engine, (pair.engine.runner, pair.followers[0].runner)
    a = make_prompt(50, 2)
    engine.add_request(a, greedy(2))
    engine.step()  # prefill: blocks 0..2 of a are full and cached
    pair.settle()
    table = list(engine.scheduler.running[0].block_table[:3])
    computed = [[c[:, table].clone() for c in r.kv_caches] for r in ranks]
    while engine.has_work():
        engine.step()
    evict_with_others(engine)  # a's blocks go to the host tier (demoted, or written through)
    engine.add_request(a, greedy(2))
    engine.step()  # loads on every rank, then the forward pass
    pair.settle()
    new_table = list(engine.scheduler.running[0].block_table[:3])
    assert new_table != table and engine.runner.host.stats.loads >= 3  # the followers' K/V below shows theirs
    for runner, before in zip(ranks, computed):
        for layer, cache in enumerate(runner.kv_caches):
            assert torch.equal(cache[:, new_table], before[layer])
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("policy", ["demote", "write_through"])
def test_with_a_host_tier_each_rank_copies_its_own_slice_and_the_output_equals_one_shard(policy):
    pair = TPPair(max_blocks=12, max_model_len=128, host_blocks=64, host_kv_policy=policy, overlap=False)
    try:
        assert pair.engine.host_num_blocks == 64 and pair.followers[0].runner.host.num_blocks == 64
        assert pair.followers[0].runner.host_caches[0].shape[-2] == TINY.num_kv_heads // 2  # its slice
        load_round_trip(pair)
        system = make_prompt(32, 30)
        prompts = [system + make_prompt(10 + i, 20 + i) for i in range(4)]
        outs = pair.engine.generate(prompts, greedy(40))
        single = make_engine(max_blocks=12, max_model_len=128, host_kv_memory=64 * BLOCK_BYTES,
                             host_kv_policy=policy)
        assert outs == single.generate(prompts, greedy(40))
        assert outs == [[reference(single, p, 40)] for p in prompts]
        assert pair.engine.bm.core.host.stats.loads > 0
        assert_drained(pair.engine)
    finally:
        pair.close()


def test_a_follower_that_skips_its_loads_holds_the_wrong_kv():
    """The round-trip check above fails when only rank 0 makes the host tier's loads."""
    pair = TPPair(max_blocks=12, max_model_len=128, host_blocks=64, overlap=False)
    try:
        host = pair.followers[0].runner.host
        real = host.run
        host.run = lambda saves, loads: real(saves, [])
        with pytest.raises(AssertionError):
            load_round_trip(pair)
    finally:
        pair.close()


def test_per_rank_kv_memory_halves_for_the_same_num_blocks():
    pair = TPPair(num_blocks=64)
    try:
        single = make_engine(num_blocks=64)
        tp1, tp2 = single.runner.kv_bytes, pair.engine.runner.kv_bytes
        assert pair.engine.num_blocks == single.num_blocks == 64
        assert pair.followers[0].runner.kv_bytes == tp2 == tp1 // 2 == rank_kv_bytes(64, 2)
        assert pair.engine.spec.num_kv_heads == 1 and single.spec.num_kv_heads == 2
        assert pair.engine.stats()["tp_size"] == 2 and pair.engine.stats()["kv_cache_bytes"] == tp2
        print(f"\nKV bytes per rank for {single.num_blocks} blocks of tiny (fp32): tp 1 {tp1}, tp 2 {tp2} "
              f"({tp2 / tp1:.2f}x)")
    finally:
        pair.close()


def test_the_pair_waits_for_a_slow_follower_to_register(monkeypatch):
    """The follower registers on its own thread; the helper waits for it (it once raced)."""
    real = tp_module.TPFollower.register
    gate = threading.Event()

    def slow_register(self):
        gate.wait(5)  # released only once rank 0 has finished its own registration
        real(self)

    monkeypatch.setattr(tp_module.TPFollower, "register", slow_register)
    real_engine_register = Engine.register

    def engine_register(self):
        real_engine_register(self)
        gate.set()

    monkeypatch.setattr(Engine, "register", engine_register)
    pair = TPPair(num_blocks=64)
    try:
        assert pair.followers[0].runner is not None and pair.followers[0].num_blocks == 64
    finally:
        pair.close()


def test_kv_spec_reports_the_shards_heads():
    assert kv_spec(TINY, 16, torch.float32, 2).num_kv_heads == 1
    assert kv_spec(TINY, 16, torch.float32).num_kv_heads == 2


# -- the command channel ------------------------------------------------------------------------


class FakeDist:
    """torch.distributed.broadcast between one sender and one receiver in this process."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.fail = False

    def broadcast(self, t, src):
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        if self.sending:
            self.sent.append(t.clone())
        else:
            t.copy_(self.sent.pop(0))


@pytest.mark.parametrize("num_tokens", [3, 4000])  # one broadcast, and a payload past HEAD bytes
def test_channel_frames_a_plan_in_one_or_two_broadcasts(monkeypatch, num_tokens):
    fake = FakeDist()
    monkeypatch.setattr(tp_module.dist, "broadcast", fake.broadcast)
    plan = Batch([BatchSeq(list(range(num_tokens)), 7, [4, 9, 2], True), BatchSeq([5], 0, [3], False)],
                    copies=[(3, 8)])
    channel = Channel(torch.device("cpu"))
    fake.sending = True
    channel.send(encode_plan(plan))
    assert [t.numel() for t in fake.sent][0] == HEAD and len(fake.sent) == (1 if num_tokens < 1000 else 2)
    fake.sending = False
    assert decode_plan(channel.recv()) == plan and fake.sent == []


def test_a_failed_broadcast_is_a_lost_peer_and_ticks_are_rate_limited(monkeypatch):
    fake = FakeDist()
    fake.sending = True
    monkeypatch.setattr(tp_module.dist, "broadcast", fake.broadcast)
    leader = TPLeader(Channel(torch.device("cpu")), 2, tick_s=3600)
    leader.tick()
    assert fake.sent == []  # sent nothing for less than tick_s: no tick yet
    leader.tick_s = 0
    leader.tick()
    assert len(fake.sent) == 1
    fake.fail = True
    with pytest.raises(TPPeerLost, match="Connection closed by peer"):
        leader.tick()
    leader.stop()  # best effort: the peers may be gone already


# -- the manager's registry: a lost shard ends the pool's epoch ----------------------------------

SPEC = {"block_size": 16, "num_layers": 2, "num_kv_heads": 1, "head_size": 16, "dtype": "float32"}


def test_a_shard_whose_session_ends_takes_the_pool_down_to_a_new_epoch():
    r = Registry("inc", session_timeout_s=10.0)
    s0, s1 = r.open_session("rank0", "worker", True, 1, 0.0), r.open_session("rank1", "worker", True, 1, 0.0)
    r.register(s0, "p", 0, 2, "a", KVSpec(**SPEC), 64 * 4096)
    entry = r.register(s1, "p", 1, 2, "b", KVSpec(**SPEC), 40 * 4096)
    assert (entry.state, entry.epoch, entry.pool.blocks.num_blocks) == ("ready", 1, 40)
    entry.pool.allocate((s0.sid, 1), [b"h" * 32], 17, 17)  # caches its full first block
    assert entry.pool.lookup([b"h" * 32]) == 1
    r.expire(now=5.0)
    assert entry.state == "ready"  # nobody silent yet
    s0.last_seen = 9.0
    r.expire(now=12.0)  # rank 1 silent for 12s: its KV slice may be gone
    assert (entry.state, entry.epoch, sorted(entry.shards)) == ("pending", 2, [0])
    with pytest.raises(ManagerError) as ei:
        r.ready_pool("p", 1)  # rank 0's next step
    assert ei.value.code == "stale_epoch"
    with pytest.raises(ManagerError, match="1 of 2 shards"):
        r.ready_pool("p", 2)
    s1b = r.open_session("rank1", "worker", True, 1, 12.0)
    entry = r.register(s1b, "p", 1, 2, "b2", KVSpec(**SPEC), 40 * 4096)
    assert (entry.state, entry.epoch) == ("ready", 3)
    assert entry.pool.requests == {} and entry.pool.lookup([b"h" * 32]) == 0  # no stale cache
    r.check_invariants()


def test_a_single_shard_pool_keeps_its_cache_when_its_session_ends():
    r = Registry("inc", session_timeout_s=10.0)
    s = r.open_session("w", "worker", True, 1, 0.0)
    entry = r.register(s, "p", 0, 1, "a", KVSpec(**SPEC), 16 * 4096)
    entry.pool.allocate((s.sid, 1), [b"h" * 32], 17, 17)
    assert r.end_session(s.sid) == 1
    assert (entry.state, entry.epoch, entry.pool.lookup([b"h" * 32])) == ("ready", 1, 1)


def test_a_session_holding_every_shard_leaves_a_pool_that_re_forms():
    r = Registry("inc", session_timeout_s=10.0)
    s = r.open_session("both", "worker", True, 1, 0.0)
    for rank in (0, 1):
        entry = r.register(s, "p", rank, 2, f"i{rank}", KVSpec(**SPEC), 16 * 4096)
    assert (entry.state, entry.epoch) == ("ready", 1)
    r.end_session(s.sid)
    assert (entry.state, entry.epoch, entry.spec.block_size) == ("pending", 2, 16)  # still listable
    s2 = r.open_session("both", "worker", True, 1, 1.0)
    for rank in (0, 1):  # the same processes (incarnations) come back
        entry = r.register(s2, "p", rank, 2, f"i{rank}", KVSpec(**SPEC), 16 * 4096)
    assert (entry.state, entry.epoch) == ("ready", 3)
    r.check_invariants()
