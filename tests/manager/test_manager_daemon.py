"""A real daemon (`kvpool manager`) with several client processes (slow: real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.manager import CLI, HELPERS, wait_until

from kvpool.client.manager import ManagerClient, ManagerUnavailable

pytestmark = pytest.mark.slow
PROC = [sys.executable, str(HELPERS / "manager_procs.py")]


@pytest.fixture
def daemon(procs, sock_dir):
    """Starts `kvpool manager` from a TOML config file; yields (process, endpoint, admin client)."""
    clients: list[ManagerClient] = []

    def start(session_timeout_s: float = 10.0):
        endpoint = f"ipc://{sock_dir}/manager.sock"
        cfg = Path(sock_dir) / "manager.toml"
        cfg.write_text(f'[manager]\nendpoint = "{endpoint}"\nsession_timeout_s = {session_timeout_s}\n')
        proc = procs([*CLI, "manager", "--config", str(cfg)], stdout=None)
        admin = ManagerClient(endpoint, role="admin", identity="test-admin", timeout_s=1.0)
        clients.append(admin)

        def up() -> bool:
            assert proc.poll() is None, "the daemon exited"
            try:
                admin.hello()
                return True
            except ManagerUnavailable:
                return False

        wait_until(up, 30, "the daemon to answer")
        admin.timeout_s = 20.0
        return proc, endpoint, admin

    yield start
    for c in clients:
        c.close()


def lines(proc) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.read().splitlines()]


def test_two_shard_pools_min_unification_and_four_concurrent_steppers(daemon, procs):
    _, ep, admin = daemon()
    shards = [("A", 0, "a0", 200), ("A", 1, "a1", 150), ("B", 0, "b0", 120), ("B", 1, "b1", 300)]
    ps = [procs([*PROC, "stepper", ep, pool, str(rank), "2", inc, str(blocks), "40"], stdin=subprocess.PIPE)
          for pool, rank, inc, blocks in shards]
    outs = [[json.loads(p.stdout.readline()), json.loads(p.stdout.readline())] for p in ps]
    assert [o[-1]["event"] for o in outs] == ["done"] * 4
    regs = [o[0] for o in outs]
    assert [r["num_blocks"] for r in regs] == [150, 150, 120, 120]  # the min over each pool's shards
    assert all(r["epoch"] == 1 and r["state"] == "ready" for r in regs)
    done = [o[-1] for o in outs]
    # Every process admits the same 32-token prefix first. Within a pool exactly one process
    # computes it; the other hits the blocks the first cached: hits across clients of one pool.
    # Each pool has its own miss: no hits across pools.
    for pool_done in (done[:2], done[2:]):
        assert sorted(d["first_shared_cached"] for d in pool_done) == [0, 32]
        assert all(d["cached"] > 0 for d in pool_done)
    stats = admin.stats()["pools"]
    assert stats["A"]["hit_tokens"] == done[0]["cached"] + done[1]["cached"]
    assert stats["B"]["hit_tokens"] == done[2]["cached"] + done[3]["cached"]
    for name in ("A", "B"):
        assert stats[name]["requests"] == 0 and stats[name]["free_blocks"] == stats[name]["num_blocks"] - 1
    admin.call("check")
    for p in ps:
        p.stdin.close()
        assert p.wait(60) == 0


def test_a_killed_client_gets_its_blocks_back_after_the_session_timeout(daemon, procs):
    _, ep, admin = daemon(session_timeout_s=3.0)
    holder = procs([*PROC, "holder", ep, "k"])
    held = json.loads(holder.stdout.readline())
    assert held["event"] == "holding" and held["blocks"] == 9

    def used() -> int:
        pool = next(p for p in admin.call("pools")["pools"] if p["pool"] == "k")
        return pool["num_blocks"] - 1 - pool["free_blocks"]

    assert used() == 9
    os.kill(holder.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert used() == 9  # not freed by the kill itself
    wait_until(lambda: used() == 0, 30, "the dead session's blocks")
    assert time.monotonic() - killed > 2.0  # freed by the timeout
    m = admin.stats()["manager"]
    # the holder's 3 requests, freed by its expiry (on a loaded machine the test's own admin
    # session may expire too while the holder starts: it holds no requests and reconnects)
    assert m["sessions_expired"] >= 1 and m["expired_requests_freed"] == 3
    admin.call("check")


def test_a_flood_from_one_client_does_not_starve_another(daemon, procs):
    _, ep, admin = daemon()
    flooder = procs([*PROC, "flooder", ep, "30000"])
    worker = ManagerClient(ep, identity="worker", timeout_s=20)
    epoch = worker.register("f", shard_rank=0, shard_count=1, incarnation="w",
                            spec={"block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_size": 8,
                                  "dtype": "float32"}, available_kv_bytes=64 * 256)["epoch"]
    worst = 0.0
    for i in range(60):
        t0 = time.monotonic()
        res = worker.step("f", epoch, [{"op": "alloc", "req": i, "hashes": [], "prompt_len": 5, "max_new": 5},
                                       {"op": "free", "req": i}])
        worst = max(worst, time.monotonic() - t0)
        assert [r["ok"] for r in res] == [True, True]
    assert flooder.wait(60) == 0
    wait_until(lambda: admin.stats()["manager"]["messages"] >= 30_000, 30, "the flood to be read")
    m = admin.stats()["manager"]
    assert m["errors"]["bad_message"] >= 20_000 and "internal" not in m["errors"]
    assert worst < 10.0, f"a step waited {worst:.1f}s behind the flood"
    admin.call("check")
    worker.close()


def test_the_daemon_keeps_its_start_up_heap_out_of_its_collections(daemon):
    """serve() freezes what start-up left (modules, config, sockets): the loop's idle full
    collection then walks only what came since (manager/server.py, serve)."""
    _, _, admin = daemon()
    wait_until(lambda: admin.stats()["manager"]["gc"]["collections"] >= 1, 10, "an idle collection")
    gc_stats = admin.stats()["manager"]["gc"]
    assert gc_stats["frozen"] > 1000


def test_sigterm_stops_the_daemon_cleanly(daemon):
    proc, ep, admin = daemon()
    admin.call("stats")
    sock_path = ep[len("ipc://"):]
    assert os.path.exists(sock_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert not os.path.exists(sock_path)
    admin.timeout_s = 0.3
    with pytest.raises(ManagerUnavailable):
        admin.call("stats")


def test_cli_against_the_daemon_then_shutdown(daemon, procs):
    proc, ep, _ = daemon()
    out = procs([*CLI, "pools", "--json", "-m", ep])
    assert out.wait(30) == 0 and json.loads(out.stdout.read()) == []
    down = procs([*CLI, "shutdown", "-m", ep])
    assert down.wait(30) == 0 and proc.wait(20) == 0
    gone = procs([*CLI, "status", "-m", ep, "--timeout", "0.3"])
    assert gone.wait(30) == 3
