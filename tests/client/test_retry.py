"""RetryPolicy and Backoff: the pauses, the deadline, the attempts."""

from __future__ import annotations

import time

import pytest

from kvpool.client.retry import RetryPolicy


def test_pauses_double_from_the_first_up_to_the_max_and_reset_to_zero():
    b = RetryPolicy(first_pause_s=0.05, max_pause_s=1.0).start()
    assert b.current_s == 0.0
    assert [b.advance() for _ in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.current_s == 0.0 and b.advance() == 0.05


def test_the_deadline_cuts_the_pause_and_ends_the_retries():
    b = RetryPolicy(deadline_s=0.05, first_pause_s=0.5, max_pause_s=0.5).start()
    assert not b.expired() and 0 < b.pause_s() <= 0.05
    t0 = time.monotonic()
    b.sleep()
    assert time.monotonic() - t0 < 0.4 and b.expired() and b.exhausted() and b.left_s() == 0.0
    assert not RetryPolicy().start().expired()  # no deadline: never


def test_attempts_are_counted_against_the_limit():
    b = RetryPolicy(attempts=2).start()
    assert b.attempt() == 1 and not b.exhausted()
    assert b.attempt() == 2 and b.exhausted()


def test_with_deadline_keeps_the_pauses():
    p = RetryPolicy(first_pause_s=0.1, max_pause_s=0.3).with_deadline(7.0)
    assert (p.deadline_s, p.first_pause_s, p.max_pause_s) == (7.0, 0.1, 0.3)


@pytest.mark.parametrize("kw", [{"deadline_s": -1}, {"deadline_s": float("inf")}, {"attempts": 0},
                                {"first_pause_s": 0}, {"first_pause_s": 1.0, "max_pause_s": 0.5},
                                {"factor": 0.5}])
def test_a_bad_policy_is_refused(kw):
    with pytest.raises(ValueError):
        RetryPolicy(**kw)
