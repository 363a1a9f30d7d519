"""A manager that misses the front door's polls for less than the grace stays reachable (one slow
answer on a loaded machine is no outage); past the grace its workers' new requests get 503
``manager_unreachable``; it is reachable again at its next answer. A real manager process,
stopped with SIGSTOP, and the front door's own ``Directory``."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kvpool.devcluster.cluster import DevCluster
from kvpool.frontend.directory import Directory

pytestmark = pytest.mark.timeout(180)
GRACE_S = 2.0


def test_polls_missed_within_the_grace_keep_a_manager_reachable_and_past_it_do_not():
    cluster = DevCluster(prefix="kvpool-grace-")
    try:
        endpoint = cluster.manager("manager")
        proc = cluster.named["manager"]

        async def run() -> None:
            d = Directory([endpoint], timeout_s=0.5, manager_grace_s=GRACE_S)
            try:
                deadline = time.monotonic() + 60
                await d.refresh()
                while not d.reachable[0]:  # a manager just started can miss a 0.5 s poll on a busy machine
                    assert time.monotonic() < deadline, "the manager never answered a poll"
                    await d.refresh()
                assert d.reachable == [True] and d.outages[0].since is None
                proc.send_signal(signal.SIGSTOP)
                try:
                    await d.refresh()  # no answer: the first miss is within the grace whatever the load
                    assert d.reachable == [True] and d.outages[0].since is not None
                    await asyncio.sleep(GRACE_S + 0.1)
                    await d.refresh()
                    assert d.reachable == [False]  # past the grace: its workers' new requests get 503
                finally:
                    proc.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 60
                while not d.reachable[0]:
                    assert time.monotonic() < deadline, "the manager was not reachable again after SIGCONT"
                    await d.refresh()
                assert d.outages[0].since is None
            finally:
                await d.close()

        asyncio.run(run())
    finally:
        cluster.stop()
