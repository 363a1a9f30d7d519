"""The `check` admin op on a state too large to check on the loop: a forked child checks it
(manager/check_job.py) while the loop serves everyone else.

A real manager loop in a thread of this process, real ZeroMQ clients; the child is a real
process, which stops itself (SIGSTOP, from an at-fork hook of this process) to hold the check
open deterministically while other clients are served.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.manager import SPEC, LiveServer, kv_bytes, wait_until

from kvpool.client.manager import ManagerClient
from kvpool.manager.check_job import INLINE_BLOCKS
from kvpool.shared.protocol import ManagerError

BLOCKS = 4 * INLINE_BLOCKS  # above the inline limit: every check forks
HOLD = {"on": False}


def _hold_child() -> None:
    if HOLD["on"]:
        os.kill(os.getpid(), signal.SIGSTOP)


os.register_at_fork(after_in_child=_hold_child)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (by a signal), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def live(tmp_path):
    srv = LiveServer(f"ipc://{tmp_path}/m.sock", max_blocks=1 << 20)
    clients: list[ManagerClient] = []

    def client(identity: str, role: str = "worker", timeout_s: float = 10.0) -> ManagerClient:
        c = ManagerClient(srv.endpoint, identity=identity, role=role, timeout_s=timeout_s)
        clients.append(c)
        return c

    yield srv, client
    for c in clients:
        c.close()
    srv.stop()


def fill(worker: ManagerClient) -> int:
    """A pool of BLOCKS blocks with 40 live requests; returns its epoch."""
    epoch = worker.register("big", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                            available_kv_bytes=kv_bytes(BLOCKS))["epoch"]
    ops = [{"op": "alloc", "req": r, "hashes": [os.urandom(32) for _ in range(7)], "prompt_len": 32, "max_new": 32}
           for r in range(40)]
    assert all(r["ok"] for r in worker.step("big", epoch, ops))
    return epoch


def test_check_of_a_large_state_answers_from_a_child(live):
    srv, client = live
    worker, admin = client("w"), client("admin", "admin")
    fill(worker)
    assert srv.server.checks.forks()
    body = admin.call("check")
    assert body == {"pools": 1, "sessions": 2, "requests": 40}
    assert srv.server.checks.children == 1
    entry = srv.server.registry.pools["big"]
    block = entry.pool.requests[next(iter(entry.pool.requests))].blocks[0]
    entry.pool.blocks.ref_cnt[block] += 1  # a broken state (a manager bug): the check must say so
    try:
        with pytest.raises(ManagerError) as e:
            admin.call("check")
        assert e.value.code == "invariant_broken" and f"block {block}" in e.value.message
        assert srv.server.checks.children == 2
    finally:
        entry.pool.blocks.ref_cnt[block] -= 1
    assert admin.call("check")["requests"] == 40  # and the state is unharmed by either check


def test_other_clients_are_served_while_a_check_runs(live):
    srv, client = live
    worker, admin, other = client("w"), client("admin", "admin", timeout_s=30), client("other")
    epoch = fill(worker)
    other.heartbeat()  # its session is open before the check is asked
    result: dict = {}
    asker = threading.Thread(target=lambda: result.update(body=admin.call("check")))
    HOLD["on"] = True  # the child stops itself before it checks anything
    try:
        asker.start()
        wait_until(lambda: srv.server.checks.running_pid is not None, 10, "the check's child")
    finally:
        HOLD["on"] = False
    pid = srv.server.checks.running_pid
    try:
        t0 = time.monotonic()
        for k in range(20):
            other.heartbeat()
            r = worker.step("big", epoch, [{"op": "alloc", "req": 100 + k, "hashes": [], "prompt_len": 8,
                                            "max_new": 8}])
            assert r[0]["ok"]
        assert time.monotonic() - t0 < 10
        assert asker.is_alive() and "body" not in result  # still waiting for its child
    finally:
        # a continue sent before the child stopped itself is lost, and the child then stays
        # stopped for good (at load 16 a new child may not run for seconds): wait for the stop
        wait_until(lambda: stopped(pid), 60, "the check's child to stop itself")
        os.kill(pid, signal.SIGCONT)
    asker.join(30)
    # The child checked the state as it was when asked: 40 requests, not the 60 of now.
    assert result["body"] == {"pools": 1, "sessions": 3, "requests": 40}
    assert admin.call("check")["requests"] == 60
