"""The node tier under durable manager state with real processes: a manager with a node tier and
Redis in sync mode, SIGKILLed while a worker is mid-generation, recovers the tier's index as it
was (its hashes by level, open batches, pins), the worker's generation goes on to the greedy
output of a contiguous reference, and a worker of another pool loads that prefix from the tier."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.durable import REDIS_URL
from helpers.node_procs import NodeCluster, generate, hashes, prompt_of, truth

pytestmark = [pytest.mark.slow, pytest.mark.redis]
N = 8


def test_a_manager_killed_mid_run_recovers_the_node_tier_and_another_pool_loads_from_it(tmp_path, namespace):
    nodes = NodeCluster(tmp_path, session_timeout_s=60.0,
                        manager_args=("--redis-url", REDIS_URL, "--namespace", namespace, "--durability", "sync"))
    try:
        a = nodes.worker("a")
        nodes.worker("b")  # a second pool of the layout, idle through the kill
        p1 = prompt_of(96, 50)
        assert generate(a, p1, N) == truth(p1, N)
        nodes.settled()
        pin = nodes.admin.call("pin", pool="a", hashes=hashes(p1)[:4], ttl_s=3600.0)
        assert pin["device_blocks"] == 4

        long = prompt_of(400, 51)
        out: list = []
        run = threading.Thread(target=lambda: out.append(generate(a, long, N, timeout_s=300.0)))
        run.start()
        deadline = time.monotonic() + 120
        while nodes.pool("a")["requests"] < 2 and time.monotonic() < deadline:  # the pin's holding, and it
            time.sleep(0.05)
        proc = nodes.cluster.named["a"]
        os.kill(proc.pid, signal.SIGSTOP)  # mid-run: nothing changes the index while the manager goes down
        try:
            time.sleep(0.5)
            before = nodes.index("a")
            assert before["node_host"]
            nodes.restart_manager()  # SIGKILL, then the same manager over the same Redis namespace
            after = nodes.index("a")
            assert after == before
            assert nodes.admin.call("check")  # every invariant: the pools', the tier's, the pins'
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        run.join(300)
        assert out == [truth(long, N)]
        nodes.settled()

        c = nodes.worker("c")  # another pool: the prefix a computed comes from the recovered tier
        assert generate(c, long, N) == truth(long, N)
        assert nodes.pool("c")["node_hit_tokens"] >= 16 * 20
        assert [p["pin_id"] for p in nodes.admin.call("pins")["pins"]] == [pin["pin_id"]]
        assert nodes.admin.call("check")
    finally:
        nodes.stop()
