"""Overlap and arrivals (worker/step_loop.py): a request that arrives while a step computes joins
the next step when the last running requests ended in the step before (a client sending its next
request when one ends), and one step later otherwise (the next plan was already sent to the
manager): while others run, a newcomer's prefill never holds back their next token."""

from __future__ import annotations

from helpers.worker import assert_drained, greedy, make_engine, make_prompt, reference


def run_until_finished(engine, rid: str) -> None:
    for _ in range(100):
        if any(ev.request_id == rid and ev.finished for ev in engine.step()):
            return
    raise AssertionError(f"{rid} never finished")


def steps_to_first_token(engine, rid: str, got: dict[str, list[int]]) -> int:
    """Steps until ``rid`` draws a token; every token drawn meanwhile into ``got``."""
    for k in range(1, 20):
        events = engine.step()
        for ev in events:
            if ev.token is not None:
                got.setdefault(ev.request_id, []).append(ev.token)
        if rid in got:
            return k
    raise AssertionError(f"{rid} drew no token")


def run_dry_and_check(engine, rid: str, prompt: list[int], n: int, got: dict[str, list[int]]) -> None:
    """Steps until nothing is left, every token into ``got``; ``rid`` drew the reference's
    ``n`` tokens for ``prompt`` and the pool is drained."""
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None:
                got.setdefault(ev.request_id, []).append(ev.token)
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


def test_after_a_finish_with_others_running_an_arrival_waits_a_step_behind_their_next_token() -> None:
    engine = make_engine()
    long = engine.add_request(make_prompt(8, 1), greedy(40))
    short = engine.add_request(make_prompt(8, 2), greedy(2))
    run_until_finished(engine, short)
    waits = engine.arrival_waits
    engine.step()  # a step computes; the client's next request arrives meanwhile
    nxt = engine.add_request(make_prompt(8, 3), greedy(3))
    out: dict[str, list[int]] = {}
    assert steps_to_first_token(engine, nxt, out) == 2  # the long one's next token went first
    assert len(out[long]) == 2 and engine.arrival_waits == waits
    run_dry_and_check(engine, nxt, make_prompt(8, 3), 3, out)


def test_without_a_finish_the_next_plan_is_sent_before_the_forward_and_an_arrival_waits_a_step() -> None:
    engine = make_engine()
    engine.add_request(make_prompt(8, 1), greedy(40))
    for _ in range(4):
        engine.step()
    waits = engine.arrival_waits
    engine.step()
    nxt = engine.add_request(make_prompt(8, 3), greedy(3))
    assert steps_to_first_token(engine, nxt, {}) == 2  # the step after next: the overlap's price
    assert engine.arrival_waits == waits
    while engine.has_work():
        engine.step()
    assert_drained(engine)
