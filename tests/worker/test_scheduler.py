"""The step message the scheduler composes and how it reacts to the manager's answers."""

from __future__ import annotations

from helpers.worker import greedy, make_engine, make_prompt

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.hashing import hash_blocks
from kvpool.worker.request import Request
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.scheduler import Scheduler

BS = 4


def make_sched(**kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BS, kw.pop("max_num_batched_tokens"), kw.pop("max_num_seqs", 8), 64, **kw)


def make_req(rid: int, n_tokens: int, first: int = 10) -> Request:
    return Request(rid, f"c{rid}", 0, list(range(first, first + n_tokens)), n_tokens,
                   SamplingParams(max_tokens=50), 0, BS)


def run(sched: Scheduler, pool: Pool, sampled: int = 7):
    """One step without a model: every sequence that reaches its end samples ``sampled``."""
    ops = sched.schedule()
    plan = sched.commit(run_step(pool, "w", ops))
    sched.advance()
    for req, _ in sched.scheduled:
        if req.num_computed == len(req.tokens):
            req.append(sampled)
    sched.end_step()
    return ops, plan


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


def test_decode_sends_the_hash_of_a_block_it_fills():
    sched, pool = make_sched(), Pool(32, BS)
    a = make_req(0, 7)
    sched.add(a)
    run(sched, pool)  # 7 tokens computed, token 8 sampled: block 1 is full once it is computed
    ops, _ = run(sched, pool)
    assert ops == [{"op": "extend", "req": 0, "num_tokens": 8,
                    "hashes": hash_blocks(a.tokens[:8], BS)[1:2], "lookahead": 0}]
    assert pool.lookup(hash_blocks(a.tokens[:8], BS)) == 2


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
    ops, _ = run(sched, pool)
    assert [(o["op"], o["req"]) for o in ops] == [("extend", 1), ("alloc", 0)]  # nobody overtakes


def test_token_budget_chunks_prefill():
    sched, pool = make_sched(max_num_batched_tokens=8), Pool(32, BS)
    a, b = make_req(0, 3), make_req(1, 20, first=40)
    sched.add(a)
    sched.add(b)
    ops, plan = run(sched, pool)
    assert [(o["req"], o["max_new"]) for o in ops] == [(0, 3), (1, 5)]
    assert [len(s.token_ids) for s in plan.seqs] == [3, 5] and [s.sample for s in plan.seqs] == [True, False]
    ops, plan = run(sched, pool)
    assert [(o["req"], o["num_tokens"]) for o in ops] == [(0, 4), (1, 12)]  # decode first, then 7
    assert sum(len(s.token_ids) for s in plan.seqs) == 8


def test_static_prealloc_reserves_max_model_len():
    sched, pool = make_sched(static_prealloc=True), Pool(64, BS)
    sched.add(make_req(0, 5))
    ops, plan = run(sched, pool)
    assert ops[0]["hashes"] == [] and ops[0]["lookahead"] == 64 - 5
    assert len(plan.seqs[0].block_table) == 64 // BS
    ops, _ = run(sched, pool)
    assert ops[0]["lookahead"] == 64 - 6 and pool.blocks.num_used == 64 // BS


def test_one_manager_message_per_step():
    engine = make_engine(max_num_batched_tokens=32)
    calls = []
    real = engine.bm.step
    engine.bm.step = lambda ops: calls.append(len(ops)) or real(ops)
    for i in range(5):
        engine.add_request(make_prompt(10 + 9 * i, i), greedy(5, n=2 if i == 2 else 1))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert len(calls) == steps and all(calls)


def test_admission_leaves_room_for_running_requests_to_grow():
    sched, pool = make_sched(), Pool(12, BS)  # 11 usable blocks
    sched.num_blocks = 12
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
    # 11 blocks held now (5 + 3 x 2): no room, so no alloc is even asked for
    assert [o["op"] for o in ops] == ["extend"] * 4
