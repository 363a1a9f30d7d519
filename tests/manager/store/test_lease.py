"""Renewing the lease while a state loads (manager/store/lease.py): a renewal that times out is
tried again (the lease may still be ours), a fenced one stops the renewing."""

from __future__ import annotations

import threading

from helpers.manager import wait_until

from kvpool.manager.store.base import Fenced, StoreUnavailable
from kvpool.manager.store.lease import renewing


def renewals(outcomes: list[BaseException | None]):
    """A renew that raises (or not) as ``outcomes`` says, in turn, then succeeds; and its calls."""
    calls: list[int] = []

    def renew() -> None:
        calls.append(len(calls))
        if len(calls) <= len(outcomes) and outcomes[len(calls) - 1] is not None:
            raise outcomes[len(calls) - 1]
    return renew, calls


def renewer_alive() -> bool:
    return any(t.name == "kvpool-lease-while-loading" for t in threading.enumerate())


def test_a_renewal_that_times_out_is_tried_again_at_the_next_turn():
    renew, calls = renewals([StoreUnavailable("timeout"), StoreUnavailable("timeout"), None])
    with renewing(renew, 0.001, "test"):
        wait_until(lambda: len(calls) >= 5, 10, "renewals after two failed ones")
        assert renewer_alive()
    assert not renewer_alive()  # the body's end stops it


def test_a_fenced_renewal_stops_the_renewing():
    renew, calls = renewals([None, Fenced("another manager holds the lease")])
    with renewing(renew, 0.001, "test"):
        wait_until(lambda: not renewer_alive(), 10, "the renewing to stop once fenced")
        assert len(calls) == 2
