"""The state store on highly available Redis, started by the test on free 127.0.0.1 ports:
Sentinel (a master, a replica, three sentinels) with the master SIGKILLed under load, and a
three-master Redis Cluster with the manager SIGKILLed under load.

Each chaos client (chaos_procs.py) checks after every step that its view of its blocks equals
the manager's, unless the manager told it that the state is gone (PROTOCOL.md section 11).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.durable import Daemon, chaos_clients, finish_chaos_clients, free_port
from helpers.manager import wait_until
from helpers.redis_topologies import Sentinel, cli, cluster

from kvpool.client.manager import ManagerClient, ManagerRestarted

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def admin_call(admin: ManagerClient, op: str) -> dict:
    """An admin call, told (at most twice) that the state started over."""
    for _ in range(3):
        try:
            return admin.call(op)
        except ManagerRestarted:
            pass
    raise AssertionError(f"{op}: the manager kept starting over")


def all_registered(admin: ManagerClient, n: int) -> bool:
    """Every chaos client has a session and the pool has seen steps."""
    return len(admin_call(admin, "sessions")["sessions"]) > n and allocations(admin) > 20 * n


def allocations(admin: ManagerClient) -> int:
    return admin_call(admin, "stats")["pools"].get("chaos", {}).get("allocations", 0)


def finish(clients: list[subprocess.Popen], stop: Path) -> list[dict]:
    outs = finish_chaos_clients(clients, stop)
    # progress, not speed: a client may spend most of a loaded run waiting out the failover
    assert all(o["event"] == "done" and o["steps"] > 0 for o in outs) and sum(o["steps"] for o in outs) > 30, \
        [{k: v for k, v in o.items() if k != "tables"} for o in outs]
    return outs


@pytest.mark.parametrize(("lagging", "min_replicas"), [(False, 0), (True, 0), (True, 1)],
                         ids=["replica-in-sync", "replica-lagging", "replica-lagging-with-wait"])
def test_a_sentinel_failover_of_the_redis_master_under_load(procs, sock_dir, tmp_path, lagging, min_replicas):
    """Replication is asynchronous: the promoted replica may lack the last acknowledged commits.
    Lagging: the replicas lose their link 0.5 s before the master dies, so the promoted one surely
    lacks some; the manager then serves a new state and every client is told (PROTOCOL.md section
    11). With redis_min_replicas=1 (two replicas, so one remains after the failover) nothing
    unreplicated is acknowledged (each commit WAITs; meanwhile clients get store_unavailable and
    resend): nobody is told."""
    s = Sentinel(procs, tmp_path, replicas=2 if min_replicas else 1)  # one must remain after the failover
    d = Daemon(procs, sock_dir, "sentinel", redis_url=s.url, high_water_file=f"{sock_dir}/hw.seq",
               redis_min_replicas=min_replicas)
    d.start()
    d.wait_active()
    stop = Path(sock_dir) / "stop"
    clients = chaos_clients(procs, d.endpoint, stop, 3, "1")
    admin = ManagerClient(d.endpoint, role="admin", identity="admin", timeout_s=0.5, failover_s=60)
    try:
        wait_until(lambda: all_registered(admin, 3), 60, "the clients")
        if lagging:  # the replicas lose their link (pointed at a dead port): what is acknowledged now
            for port in s.replica_ports:  # never reaches them
                cli(port, "REPLICAOF", "127.0.0.1", str(free_port()))
            time.sleep(0.5)
        os.kill(s.master.pid, signal.SIGKILL)  # the Redis master dies under load
        t0 = time.monotonic()
        wait_until(lambda: s.master_addr() in s.replica_ports, 30, "Sentinel to promote a replica")
        promoted = time.monotonic() - t0
        before = allocations(admin)  # answered once the manager follows Sentinel to the new master
        wait_until(lambda: allocations(admin) > before + 60, 60, "steps on the promoted master")
        served = time.monotonic() - t0
        assert d.proc.poll() is None
        outs = finish(clients, stop)
        assert admin_call(admin, "check")["pools"] == 1
        assert "role:master" in cli(s.master_addr(), "INFO", "replication")
    finally:
        stop.touch()
        admin.close()
    told = [o["told"] for o in outs]
    if lagging and not min_replicas:
        assert all(t >= 1 for t in told), told
    if min_replicas:
        assert told == [0, 0, 0], told  # every acknowledged step survived the failover
    print(f"Sentinel promoted the replica {promoted:.1f}s after the master died; the manager served again "
          f"{served:.1f}s after; clients told of lost acks: {told}; steps {[o['steps'] for o in outs]}")


def test_a_three_master_cluster_under_manager_kills(procs, sock_dir, tmp_path):
    ports = cluster(procs, tmp_path)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:2])
    d = Daemon(procs, sock_dir, "cluster", redis_url=url, snapshot_bytes=32 << 10,
               high_water_file=f"{sock_dir}/hw.seq")
    d.start()
    d.wait_active()
    slots = {cli(ports[0], "CLUSTER", "KEYSLOT", f"kvpool:{{cluster}}:{k}") for k in ("snap", "journal", "seq")}
    assert len(slots) == 1  # one hash tag: every key of the namespace in one slot, so scripts are atomic
    stop = Path(sock_dir) / "stop"
    clients = chaos_clients(procs, d.endpoint, stop, 2, "1")
    admin = ManagerClient(d.endpoint, role="admin", identity="admin", timeout_s=0.5, failover_s=60)
    try:
        wait_until(lambda: all_registered(admin, 2), 60, "the clients")
        for _ in range(4):
            time.sleep(0.3)
            d.kill()
            d.start()
            assert admin.call("check")["pools"] == 1
        stats = admin.stats()["store"]
        outs = finish(clients, stop)
    finally:
        stop.touch()
        admin.close()
    assert all(o["told"] == 0 for o in outs), outs  # sync: nothing acknowledged was lost
    assert len({o["state_id"] for o in outs}) == 1
    assert stats["snapshots"] >= 1 or stats["snapshot_seq"] > 0
    print(f"cluster of {len(ports)} masters: 4 manager kills, steps {[o['steps'] for o in outs]}, store {stats}")
