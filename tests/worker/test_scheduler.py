"""The step message the scheduler composes and how it reacts to the manager's answers."""

from __future__ import annotations

import pytest
from helpers.worker import greedy, make_engine, make_prompt

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.step_ops import Free, encode_ops, encode_results
from kvpool.worker.request import Request
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Output, Scheduler

BS = 4


def make_sched(**kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BS, kw.pop("max_num_batched_tokens"), kw.pop("max_num_seqs", 8), 64, **kw)


def make_req(rid: int, n_tokens: int, first: int = 10) -> Request:
    return Request(rid, f"c{rid}", 0, list(range(first, first + n_tokens)), n_tokens,
                   SamplingParams(max_tokens=50), 0, BS)


def run(sched: Scheduler, pool: Pool, sampled: int = 7):
    """One step without a model: every sequence that reaches its end samples ``sampled``."""
    plan = sched.schedule()
    results = run_step(pool, "w", plan.ops)
    batch = plan.batch(results)
    sched.update(plan, results, [Output(req, sampled) for req, s in zip(batch.reqs, batch.seqs) if s.sample])
    return encode_ops(plan.ops), batch


def test_admission_ops_exact():
    sched, pool = make_sched(), Pool(32, BS)
    a, b = make_req(0, 9), make_req(1, 3)
    sched.add(a)
    sched.add(b)
    ops, plan = run(sched, pool)
    assert ops == [
        {"op": "alloc", "req": 0, "hashes": hash_blocks(a.tokens[:9], BS), "prompt_len": 9,
         "max_new": 9, "lookahead": 0},
        {"op": "alloc", "req": 1, "hashes": [], "prompt_len": 3, "max_new": 3, "lookahead": 0},
    ]
    assert [s.block_table for s in plan.seqs] == [[1, 2, 3], [4]]
    assert [(s.start, len(s.token_ids), s.sample) for s in plan.seqs] == [(0, 9, True), (0, 3, True)]


def test_step_message_order_frees_forks_extends_allocs():
    sched, pool = make_sched(), Pool(32, BS)
    a, b = make_req(0, 8), make_req(1, 6)
    sched.add(a)
    sched.add(b)
    run(sched, pool)  # both prefilled, each sampled one token
    sched.finish(b, "stop")
    child = make_req(5, 8)
    child.tokens = a.tokens[:8] + [9]
    sched.spawn(a, child)
    sched.add(make_req(2, 5, first=100))
    ops, _ = run(sched, pool)
    assert [(o["op"], o["req"]) for o in ops] == [("fork", 0), ("free", 1), ("extend", 0), ("extend", 5),
                                                   ("alloc", 2)]
    # token 8 fills block 2 for nobody: 9 tokens, only full blocks are hashed
    assert ops[2] == {"op": "extend", "req": 0, "num_tokens": 9, "hashes": [], "lookahead": 0}
    assert ops[0]["child"] == 5


def test_decode_sends_the_hash_of_a_full_block_with_its_next_block():
    sched, pool = make_sched(), Pool(32, BS)
    a = make_req(0, 7)
    sched.add(a)
    run(sched, pool)  # 7 tokens computed, token 8 sampled: block 1 is full once it is computed
    ops, batch = run(sched, pool)
    assert ops == [] and [(s.start, s.block_table) for s in batch.seqs] == [(7, [1, 2])]  # slot 8 is held
    ops, _ = run(sched, pool)  # token 9 needs block 3; block 1's hash rides along
    assert ops == [{"op": "extend", "req": 0, "num_tokens": 9,
                    "hashes": hash_blocks(a.tokens[:8], BS)[1:2], "lookahead": 0}]
    assert pool.lookup(hash_blocks(a.tokens[:8], BS)) == 2
    assert pool.requests[("w", 0)].num_tokens == 9


def test_preempts_newest_first_and_resumes():
    # 7 blocks = null + 6: three requests of 2 full blocks each leave nothing for decode
    sched, pool = make_sched(), Pool(7, BS)
    reqs = [make_req(i, 8, first=10 * i + 10) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run(sched, pool)
    ops, plan = run(sched, pool)
    assert [o["op"] for o in ops] == ["extend"] * 3
    assert plan.seqs == []  # all three refused
    assert sched.running == reqs[:2] and list(sched.waiting) == [reqs[2]]  # newest preempted
    assert reqs[2].num_computed == 0 and reqs[2].block_table == []
    assert sched.stats.preemptions == 1
    ops, plan = run(sched, pool)  # its free goes first; admissions pause for a step
    assert [(o["op"], o["req"]) for o in ops] == [("free", 2), ("extend", 0), ("extend", 1)]
    assert len(plan.seqs) == 2
    pool.check_invariants()


def test_victim_that_ran_is_preempted_after_its_step():
    sched, pool = make_sched(), Pool(8, BS)  # 7 usable blocks
    old, new = make_req(0, 8), make_req(1, 11, first=50)  # 2 + 3 blocks
    sched.add(old)
    sched.add(new)
    run(sched, pool)
    pool.allocate("squatter", [], 8, 8)  # the last 2 free blocks
    ops, plan = run(sched, pool)
    # old needs a third block and is refused; new fits its 12th token in its own blocks, runs,
    # and is the victim: its step is kept (its token sampled), then it is preempted
    assert [(s.start, len(s.token_ids)) for s in plan.seqs] == [(11, 1)]
    assert sched.running == [old] and list(sched.waiting) == [new]
    assert len(new.tokens) == 13 and new.num_computed == 0 and new.block_table == []
    assert sched.pending_frees == [1]
    ops, plan = run(sched, pool)
    assert [(o["op"], o["req"]) for o in ops] == [("free", 1), ("extend", 0)]
    assert [(s.start, len(s.token_ids)) for s in plan.seqs] == [(8, 1)]
    pool.check_invariants()


def test_head_of_line_blocks_later_admissions():
    sched, pool = make_sched(), Pool(5, BS)  # 4 usable blocks
    big, small = make_req(0, 20), make_req(1, 2, first=90)
    sched.add(big)
    sched.add(small)
    ops, _ = run(sched, pool)
    assert [o["req"] for o in ops] == [0, 1]  # both tried; big refused, small admitted
    sched.add(make_req(2, 2, first=70))
    ops, batch = run(sched, pool)
    assert [(o["op"], o["req"]) for o in ops] == [("alloc", 0)]  # nobody overtakes
    assert [(s.start, s.block_table) for s in batch.seqs] == [(2, [1])]  # small decodes in its block


def test_token_budget_chunks_prefill():
    sched, pool = make_sched(max_num_batched_tokens=8), Pool(32, BS)
    a, b = make_req(0, 3), make_req(1, 20, first=40)
    sched.add(a)
    sched.add(b)
    ops, plan = run(sched, pool)
    assert [(o["req"], o["max_new"]) for o in ops] == [(0, 3), (1, 5)]
    assert [len(s.token_ids) for s in plan.seqs] == [3, 5] and [s.sample for s in plan.seqs] == [True, False]
    ops, plan = run(sched, pool)
    assert [(o["req"], o["num_tokens"]) for o in ops] == [(1, 12)]  # 0 decodes in its block, then 7
    assert [(s.start, len(s.token_ids)) for s in plan.seqs] == [(3, 1), (5, 7)]
    assert sum(len(s.token_ids) for s in plan.seqs) == 8


def test_static_prealloc_reserves_max_model_len():
    sched, pool = make_sched(static_prealloc=True), Pool(64, BS)
    sched.add(make_req(0, 5))
    ops, plan = run(sched, pool)
    assert ops[0]["hashes"] == [] and ops[0]["lookahead"] == 64 - 5
    assert len(plan.seqs[0].block_table) == 64 // BS
    ops, _ = run(sched, pool)
    assert ops == [] and pool.blocks.num_used == 64 // BS  # it holds every block it will need


def test_one_manager_message_per_step():
    engine = make_engine(max_num_batched_tokens=32)
    calls = []
    real = engine.bm.send_step
    engine.bm.send_step = lambda ops: calls.append(len(ops)) or real(ops)
    for i in range(5):
        engine.add_request(make_prompt(10 + 9 * i, i), greedy(5, n=2 if i == 2 else 1))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert 0 < len(calls) <= steps and all(calls)  # a step with nothing to ask sends nothing


def test_admission_leaves_room_for_running_requests_to_grow():
    sched, pool = make_sched(), Pool(12, BS)  # 11 usable blocks
    sched.set_pool_size(12)
    first = make_req(0, 16)  # 4 blocks
    sched.add(first)
    run(sched, pool)
    for i in range(1, 4):
        sched.add(make_req(i, 8, first=20 * i))  # 2 blocks each
    ops, _ = run(sched, pool)
    # room = 11 usable - 4 held - 1 (one block of growth per running request) = 6: three
    # 2-block prompts fit
    assert [(o["op"], o["req"]) for o in ops] == [("extend", 0), ("alloc", 1), ("alloc", 2), ("alloc", 3)]
    sched.add(make_req(9, 8, first=200))
    ops, _ = run(sched, pool)
    # 11 blocks held now (5 + 3 x 2): no room, so no alloc is even asked for; request 0
    # writes its 18th token into the block it got last step
    assert [(o["op"], o["req"]) for o in ops] == [("extend", 1), ("extend", 2), ("extend", 3)]


def test_decode_steps_carry_one_sub_op_per_block_a_request_enters():
    """Sparse step messages: R decoding requests send about R / block_size sub-ops a step, exactly
    one per block boundary crossed, and the manager's num_tokens never runs ahead or behind by a
    block (PROTOCOL.md, "Sparse steps")."""
    bs, num_reqs, steps = 16, 64, 48
    sched, pool = Scheduler(bs, 4096, num_reqs, 256), Pool(2048, bs)
    prompts = [5 + (7 * i) % 40 for i in range(num_reqs)]
    reqs = [Request(i, f"c{i}", 0, list(range(3, 3 + n)), n, SamplingParams(max_tokens=200), 0, bs)
            for i, n in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    run(sched, pool)  # every prompt admitted and prefilled; each sampled a token
    counts = []
    for _ in range(steps):
        ops, batch = run(sched, pool)
        assert len(batch.seqs) == num_reqs and all(o["op"] == "extend" for o in ops)
        counts.append(len(ops))
        for r in reqs:
            held = pool.requests[("w", r.rid)]
            assert -(-held.num_tokens // bs) == len(held.blocks) == -(-r.num_computed // bs)
    crossings = sum(-(-(n + steps) // bs) - -(-n // bs) for n in prompts)
    assert sum(counts) == crossings  # 64 * 48 / 16 = 192 give or take the prompts' phases
    assert sum(counts) / steps == pytest.approx(num_reqs / bs, rel=0.1)
    pool.check_invariants()


def test_a_fork_first_brings_the_managers_view_of_the_parent_up_to_date():
    sched, pool = make_sched(max_num_batched_tokens=6), Pool(32, BS)
    a = Request(0, "c0", 0, list(range(10, 21)), 11, SamplingParams(max_tokens=9, n=2), 0, BS)
    sched.add(a)
    run(sched, pool)  # 6 tokens: 2 blocks held (8 slots)
    ops, _ = run(sched, pool)  # the last 5 prompt tokens: a third block
    assert pool.requests[("w", 0)].num_tokens == 11 and ops[0]["num_tokens"] == 11
    child = Request(1, "c0", 1, a.tokens[:11], 11, a.params, 0, BS)
    child.append(9)
    sched.spawn(a, child)
    a.step.num_computed = 11
    pool.requests[("w", 0)].num_tokens = 9  # as if the last chunk had fit blocks it held
    a.kv.synced_tokens = 9
    ops, batch = run(sched, pool)
    assert [(o["op"], o["req"], o.get("num_tokens")) for o in ops] == [
        ("extend", 0, 11), ("fork", 0, None), ("extend", 0, 12), ("extend", 1, 12)]
    parent_table, child_table = (s.block_table for s in batch.seqs)
    assert parent_table[:2] == child_table[:2] and parent_table[2] != child_table[2]  # copied on write
    pool.check_invariants()


def pipelined(sched: Scheduler, pool: Pool, steps: int, sampled: int = 7) -> list[tuple[list[dict], list[dict]]]:
    """Overlapped steps without a model: step N+1's message reaches the manager before step N's
    outcome is applied. Returns each message and its results."""
    sent, ready = [], None
    for _ in range(steps):
        if ready is None:
            plan = sched.schedule()
            results = run_step(pool, "w", plan.ops)
            sent.append((encode_ops(plan.ops), encode_results(results)))
            ready = (plan, results, plan.batch(results))
        plan, results, batch = ready
        following = sched.schedule()
        answers = run_step(pool, "w", following.ops)
        sent.append((encode_ops(following.ops), encode_results(answers)))
        sched.update(plan, results, [Output(r, sampled) for r, s in zip(batch.reqs, batch.seqs) if s.sample])
        ready = (following, answers, following.batch(answers)) if following.ops or following.seqs else None
    return sent


def test_overlap_a_finished_request_frees_the_block_its_next_step_took():
    sched, pool = make_sched(), Pool(32, BS)
    a = Request(0, "c0", 0, list(range(10, 17)), 7, SamplingParams(max_tokens=2), 0, BS)
    sched.add(a)
    sent = pipelined(sched, pool, 3)
    ops = [o for msg, _ in sent for o in msg]
    # token 8 fits block 2; the step after it assumes token 9 and asks for block 3 on the count
    # step 1 left (base 7), with the hash of block 2 that token 8 fills; the request finishes
    # with token 9, so block 3 is freed unused
    assert {"op": "extend", "req": 0, "num_tokens": 9, "hashes": hash_blocks(a.tokens[:8], BS)[1:2],
            "lookahead": 0, "base": 7} in ops
    assert a.finish_reason == "length" and len(a.tokens) == 9
    assert ops[-1] == {"op": "free", "req": 0, "computed": 8} and not sched.has_work()  # token 9 never ran
    assert pool.snapshot_stats()["used_blocks"] == 0
    pool.check_invariants()


def test_overlap_a_refused_request_keeps_its_blocks_and_its_step_in_flight_is_void():
    sched, pool = make_sched(), Pool(7, BS)  # three 8-token prompts fill all 6 blocks
    reqs = [make_req(i, 8, first=10 * i + 10) for i in range(3)]
    for r in reqs:
        sched.add(r)
    sent = pipelined(sched, pool, 4)
    # the whole prompts' allocs are in flight when token 9's extends leave, built on them (base 8)
    assert [(o["num_tokens"], o["base"], r["code"]) for o, r in zip(*sent[1])] == [(9, 8, "no_space")] * 3
    assert sent[2] == ([], [])  # token 10 would fit the block token 9 asked for: nothing to send
    # newest preempted; the other two were rewound (their in-flight step voided) and retry
    assert [(o["op"], o["req"], o.get("base")) for o in sent[3][0]] == [
        ("free", 2, None), ("extend", 0, None), ("extend", 1, None)]
    assert sched.running[:2] == reqs[:2] and sent[4][0][0]["req"] == 2  # it asks to come back
    assert [r.num_computed for r in reqs] == [9, 9, 0] and sched.stats.preemptions == 1
    for r in reqs[:2]:
        assert pool.requests[("w", r.rid)].blocks == r.block_table and len(r.block_table) == 3
    pool.check_invariants()


def test_overlap_a_step_built_on_a_refused_one_is_refused_with_stale_base():
    sched, pool = make_sched(max_num_batched_tokens=8), Pool(4, BS)  # 3 usable blocks
    a = make_req(0, 20)
    sched.add(a)
    sent = pipelined(sched, pool, 3)
    assert [(o["num_tokens"], o.get("base"), r.get("code")) for msg, res in sent[2:4] for o, r in zip(msg, res)] \
        == [(16, None, "no_space"), (20, 16, "stale_base")]  # 8 more prompt tokens, then the last 4
    assert list(sched.waiting) == [a] and a.num_computed == 0  # preempted before either ran
    assert [o["op"] for o in sent[4][0]] == ["free"] and ("w", 0) not in pool.requests
    assert pool.lookup(a.hasher.hashes) == 2  # the 8 computed tokens; nothing uncomputed
    pool.check_invariants()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_with_overlap_the_next_block_is_asked_for_before_the_token_that_needs_it_is_sampled(overlap):
    engine = make_engine(overlap=overlap)
    rid = engine.add_request(make_prompt(16, 3), greedy(40))
    req = engine.scheduler.waiting[0]
    asked = []  # (num_tokens of each extend, tokens the request knew when it was sent, base)
    real = engine.bm.send_step

    def send(ops):
        asked.extend((o["num_tokens"], len(req.tokens), o.get("base")) for o in encode_ops(ops) if o["op"] == "extend")
        return real(ops)

    engine.bm.send_step = send
    while engine.has_work():
        engine.step()
    assert [t for t, _, _ in asked] == [17, 33, 49]  # one extend per block entered
    # the step asked for computes the token at index num_tokens - 1: without overlap it is
    # known when the message leaves; with overlap the message leaves while the step before
    # (which samples it) runs, built on that step's count: the first one on the admission's
    assert asked == ([(17, 16, 16), (33, 32, 17), (49, 48, 33)] if overlap
                     else [(17, 17, None), (33, 33, None), (49, 49, None)])
    assert rid not in engine._requests


def test_release_all_hands_over_running_and_owed_frees():
    """Shutdown takes every request the manager holds blocks for from the running set (running
    ones and frees not yet sent), and freeing those ids returns the whole pool."""
    sched, pool = make_sched(), Pool(32, BS)
    a, b, c = make_req(0, 8), make_req(1, 6), make_req(2, 5, first=40)
    for r in (a, b):
        sched.add(r)
    run(sched, pool)
    sched.finish(b, "stop")  # its free is owed to the manager, not yet sent
    sched.add(c)  # waiting: the manager holds nothing for it
    assert pool.snapshot_stats()["used_blocks"] > 0
    rids = sched.release_all()
    assert sorted(rids) == [0, 1]
    assert sched.running == [] and sched.pending_frees == []
    assert list(sched.waiting) == [c] and sched.has_work()
    run_step(pool, "w", [Free(rid) for rid in rids])
    assert pool.snapshot_stats()["used_blocks"] == 0 and pool.snapshot_stats()["requests"] == 0
