"""Overlap and arrivals (worker/step_loop.py): a request that arrives while a step computes joins
the very next step. When the last running requests ended in the step before (a client sending its
next request when one ends), the next plan is composed after the forward pass; otherwise the next
plan was already answered, and the newcomers join it by a message of their own (``admit_late``),
beside the running requests' next tokens, as a synchronous scheduler would admit them. Not when
the answered plan carries tier copies, and never past a request the plan left waiting."""

from __future__ import annotations

import pytest
from helpers.worker import (
    BLOCK_BYTES,
    assert_drained,
    greedy,
    make_engine,
    make_prompt,
    reference,
    run_dry,
    step_tokens,
)

from kvpool.shared.protocol import ManagerError
from kvpool.shared.step_ops import Alloc


def run_until_finished(engine, rid: str) -> None:
    for _ in range(100):
        if any(ev.request_id == rid and ev.finished for ev in engine.step()):
            return
    raise AssertionError(f"{rid} never finished")


def steps_to_first_token(engine, rid: str, got: dict[str, list[int]]) -> int:
    """Steps until ``rid`` draws a token; every token drawn meanwhile into ``got``."""
    for k in range(1, 20):
        step_tokens(engine, got)
        if rid in got:
            return k
    raise AssertionError(f"{rid} drew no token")


def run_dry_and_check(engine, rid: str, prompt: list[int], n: int, got: dict[str, list[int]]) -> None:
    """Steps until nothing is left, every token into ``got``; ``rid`` drew the reference's
    ``n`` tokens for ``prompt`` and the pool is drained."""
    run_dry(engine, got)
    assert got[rid] == reference(engine, prompt, n)
    assert_drained(engine)


def test_after_the_last_running_request_ends_an_arrival_during_the_next_step_joins_the_step_after_it() -> None:
    engine = make_engine()
    short = engine.add_request(make_prompt(8, 2), greedy(2))
    run_until_finished(engine, short)
    waits = engine.arrival_waits
    engine.step()  # a step computes; the client's next request arrives meanwhile
    nxt = engine.add_request(make_prompt(8, 3), greedy(3))
    out: dict[str, list[int]] = {}
    assert steps_to_first_token(engine, nxt, out) == 1  # its prefill ran in the very next step
    assert engine.arrival_waits == waits + 1
    run_dry_and_check(engine, nxt, make_prompt(8, 3), 3, out)


def test_with_others_running_an_arrival_joins_the_next_step_beside_their_next_token() -> None:
    engine = make_engine()
    long = engine.add_request(make_prompt(8, 1), greedy(40))
    short = engine.add_request(make_prompt(8, 2), greedy(2))
    run_until_finished(engine, short)
    waits, late = engine.arrival_waits, engine.late_admissions
    engine.step()  # a step computes; the client's next request arrives meanwhile
    nxt = engine.add_request(make_prompt(8, 3), greedy(3))
    out: dict[str, list[int]] = {}
    assert steps_to_first_token(engine, nxt, out) == 1  # its prefill ran in the very next step
    assert len(out[long]) == 1  # beside the long one's next token
    assert engine.arrival_waits == waits and engine.late_admissions == late + 1
    run_dry_and_check(engine, nxt, make_prompt(8, 3), 3, out)
    assert out[long] == reference(engine, make_prompt(8, 1), 40)[-len(out[long]):]


def test_newcomers_arriving_together_join_one_step_in_their_order() -> None:
    engine = make_engine()
    engine.add_request(make_prompt(8, 1), greedy(30))
    for _ in range(4):
        engine.step()
    late = engine.late_admissions
    prompts = [make_prompt(20 + 9 * i, 10 + i) for i in range(3)]
    ids = [engine.add_request(p, greedy(4)) for p in prompts]
    out: dict[str, list[int]] = {}
    assert steps_to_first_token(engine, ids[-1], out) == 1
    assert all(rid in out for rid in ids) and engine.late_admissions == late + 1  # one message for all three
    run_dry(engine, out)
    for rid, p in zip(ids, prompts, strict=True):
        assert out[rid] == reference(engine, p, 4)
    assert_drained(engine)


def test_a_newcomer_never_passes_a_request_the_plan_left_waiting() -> None:
    # without chunked prefill a prompt larger than what the step's budget has left waits whole
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256)
    long = engine.add_request(make_prompt(8, 1), greedy(30))
    engine.step()
    engine.step()
    prompts = {engine.add_request(p, greedy(2)): p for p in (make_prompt(200, 4 + i) for i in range(3))}
    out: dict[str, list[int]] = {}
    step_tokens(engine, out)  # the first joins late, the second the next plan, which leaves the third waiting
    third = list(prompts)[2]
    assert len(engine.scheduler.waiting) == 1 and engine.scheduler.waiting[0].request_id == third
    small = engine.add_request(make_prompt(8, 7), greedy(2))  # would fit what the plan left
    prompts[small] = make_prompt(8, 7)
    while third not in out:
        step_tokens(engine, out)
        assert small not in out or len(out[small]) <= len(out[third])  # never ahead of the third
    run_dry(engine, out)
    for rid, p in prompts.items():
        assert out[rid] == reference(engine, p, 2)
    assert long in out
    assert_drained(engine)


def test_no_late_admission_into_a_plan_with_tier_copies() -> None:
    """A plan whose answers carry host-tier writes (write-through of blocks it fills) runs as
    answered: a newcomer waits for the next plan."""
    engine = make_engine(max_blocks=24, host_kv_memory=64 * BLOCK_BYTES, host_kv_policy="write_through")
    long = engine.add_request(make_prompt(40, 1), greedy(60))
    for _ in range(60):
        engine.step()
        if engine._ready is not None and engine._ready[2].writes:
            break
    else:
        raise AssertionError("no answered plan with write-through orders")
    late = engine.late_admissions
    nxt = engine.add_request(make_prompt(8, 3), greedy(3))
    out: dict[str, list[int]] = {}
    assert steps_to_first_token(engine, nxt, out) == 2 and engine.late_admissions == late
    run_dry_and_check(engine, nxt, make_prompt(8, 3), 3, out)
    assert out[long] == reference(engine, make_prompt(40, 1), 60)[-len(out[long]):]


@pytest.mark.parametrize("failure", ["reset", "refused"])
def test_a_late_admission_the_manager_loses_or_refuses_starts_every_request_over(failure) -> None:
    engine = make_engine()
    first = engine.add_request(make_prompt(20, 1), greedy(12))
    for _ in range(3):
        engine.step()
    real = engine.bm.send_step
    failed = []

    def send(ops, *reports):
        if not failed and ops and all(type(op) is Alloc for op in ops):  # the newcomer's own message
            failed.append(ops)
            if failure == "reset":
                engine.bm.simulate_restart()
            else:
                raise ManagerError("store_unavailable", "the store did not answer")
        return real(ops, *reports)

    engine.bm.send_step = send
    nxt = engine.add_request(make_prompt(30, 2), greedy(6))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        try:
            step_tokens(engine, out)
        except ManagerError:
            continue  # the server logs it and steps again
    assert failed and engine.stats()["resets"] == (failure == "reset")
    assert out[nxt] == reference(engine, make_prompt(30, 2), 6)
    assert out[first] == reference(engine, make_prompt(20, 1), 12)[-len(out[first]):]
    assert_drained(engine)


def test_without_overlap_an_arrival_joins_the_next_step() -> None:
    engine = make_engine(overlap=False)
    engine.add_request(make_prompt(8, 1), greedy(40))
    for _ in range(4):
        engine.step()
    engine.step()
    nxt = engine.add_request(make_prompt(8, 3), greedy(3))
    assert steps_to_first_token(engine, nxt, {}) == 1
    assert engine.late_admissions == 0
    while engine.has_work():
        engine.step()
    assert_drained(engine)
