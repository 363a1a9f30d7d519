"""Real processes on the real Redis: standby takeover, a paused old active fenced out, Redis
stopped and killed, a corrupt state refused, a killed worker's blocks coming back."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers.durable import Daemon, redis_or_skip, seed_big_state
from helpers.manager import CLI, HELPERS, SPEC, kv_bytes, wait_until

from kvpool.client.manager import ManagerClient
from kvpool.shared.protocol import encode_request, unpack

pytestmark = [pytest.mark.slow, pytest.mark.redis]
PROC = [sys.executable, str(HELPERS / "manager_procs.py")]
ALLOC = [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 10, "max_new": 10}]


def worker(endpoints: list[str], pool: str = "p") -> tuple[ManagerClient, int]:
    c = ManagerClient(endpoints, identity="failover-worker", timeout_s=0.5, failover_s=30.0)
    epoch = c.register(pool, shard_rank=0, shard_count=1, incarnation="w", spec=SPEC,
                       available_kv_bytes=kv_bytes(64))["epoch"]
    return c, epoch


def raw(endpoint: str, op: str, sid: str | None, timeout_s: float = 3.0, msg_id: int = 1 << 40,
        **args) -> dict | None:
    """One request on a fresh socket, no retries: what a manager answers right now."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode_request(msg_id, op, sid, args))
        return unpack(sock.recv()) if sock.poll(timeout_s * 1000) else None
    finally:
        sock.close()


def test_a_standby_takes_over_and_a_paused_old_active_is_fenced(procs, sock_dir, namespace):
    a = Daemon(procs, sock_dir, namespace, name="a")
    b = Daemon(procs, sock_dir, namespace, name="b")
    a.start()
    a.wait_active()
    b.start()
    time.sleep(0.5)
    assert raw(b.endpoint, "hello", None)["status"] == "not_active"  # b stands by
    c, epoch = worker([b.endpoint, a.endpoint])  # the standby first: the client moves on to a
    assert c.endpoint == a.endpoint
    first = c.step("p", epoch, ALLOC)[0]
    os.kill(a.proc.pid, signal.SIGSTOP)  # the active one hangs (GC pause, VM freeze, partition)
    t0 = time.monotonic()
    second = c.step("p", epoch, [{"op": "alloc", "req": 2, "hashes": [], "prompt_len": 10, "max_new": 10}])[0]
    takeover = time.monotonic() - t0
    assert c.endpoint == b.endpoint and takeover < 5.0, takeover  # lease 1 s + standby poll 0.2 s + retries
    assert first["ok"] and second["ok"] and not set(first["blocks"]) & set(second["blocks"])
    os.kill(a.proc.pid, signal.SIGCONT)  # it wakes up: its next commit finds b's fencing token
    assert a.proc.wait(10) == 75
    rows = c.call("requests", pool="p", block_ids=True)["requests"]
    assert {r["req"]: r["block_ids"] for r in rows} == {1: first["blocks"], 2: second["blocks"]}
    c.call("check")
    c.close()
    print(f"standby took over (the client's step answered) {takeover:.2f}s after the active one hung")


def test_a_standby_killed_while_loading_holds_the_lease_only_briefly(procs, sock_dir, namespace):
    """The lease is renewed in small steps while a state loads: a standby that dies mid-load
    stops renewing it, and the next standby serves within seconds (it once held 120 s)."""
    r = redis_or_skip()
    seed_big_state(namespace, 1 << 23)  # 8M blocks: over 2 s to load (1.3 s for 4M on a slow core)
    b = Daemon(procs, sock_dir, namespace, name="b", lease_ms=600, redis_timeout_s=0.3)
    c = Daemon(procs, sock_dir, namespace, name="c", lease_ms=600, redis_timeout_s=0.3)
    b.start()
    lease = f"kvpool:{{{namespace}}}:lease"
    wait_until(lambda: (r.get(lease) or b"").endswith(b.endpoint.encode()), 30, "b to take the lease")
    took_lease = time.monotonic()
    c.start()  # a standby beside the loading one
    time.sleep(max(0.0, took_lease + 0.9 - time.monotonic()))  # past lease_ms: b renewed while loading
    assert (r.get(lease) or b"").endswith(b.endpoint.encode())
    assert raw(b.endpoint, "hello", None, timeout_s=0.05) is None  # b is still loading: no answer yet
    b.kill()
    t0 = time.monotonic()
    c.wait_active(30)
    took = time.monotonic() - t0
    assert took < 10.0, took  # lease 0.6 s + standby poll 0.12 s + c's own load
    assert raw(c.endpoint, "hello", None)["status"] == "ok"
    print(f"a standby killed mid-load: the next one served {took:.2f}s later")


def test_redis_stopped_then_killed_answers_errors_and_recovers(procs, sock_dir, namespace, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", "",
           "--appendonly", "yes", "--appendfsync", "always"]
    redis_proc = procs(cmd, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip()
               == b"PONG", 10, "redis-server")
    d = Daemon(procs, sock_dir, namespace, redis_url=url)
    d.start()
    d.wait_active()
    c, epoch = worker([d.endpoint])
    held = c.step("p", epoch, ALLOC)[0]["blocks"]
    probe = ManagerClient(d.endpoint, identity="probe", role="admin", timeout_s=1.0)  # raw steps on c's pool
    probe.hello()

    def probe_step(rid: int) -> dict | None:
        return raw(d.endpoint, "step", probe.sid, msg_id=1000 + rid, pool="p", epoch=epoch,
                   ops=[{"op": "alloc", "req": rid, "hashes": [], "prompt_len": 10, "max_new": 10}])

    os.kill(redis_proc.pid, signal.SIGSTOP)  # Redis unreachable: commits time out
    assert probe_step(1)["status"] == "store_unavailable"  # nothing acknowledged
    assert raw(d.endpoint, "heartbeat", c.sid)["status"] == "store_unavailable"
    os.kill(redis_proc.pid, signal.SIGCONT)
    wait_until(lambda: raw(d.endpoint, "heartbeat", c.sid)["status"] == "ok", 20, "the manager to recover")
    rows = c.call("requests", pool="p", block_ids=True)["requests"]
    mine = [r for r in rows if r["session"] == c.session]
    assert [(r["req"], r["block_ids"]) for r in mine] == [(1, held)]  # the probe's alloc may have committed
    os.kill(redis_proc.pid, signal.SIGKILL)  # Redis dies; its append-only file has every commit
    redis_proc.wait(10)
    assert probe_step(2)["status"] == "store_unavailable"
    procs(cmd, stdout=subprocess.DEVNULL)
    got = c.step("p", epoch, [{"op": "free", "req": 1}])  # resent until Redis and the manager are back
    assert got == [{"ok": True}]
    assert d.proc.poll() is None
    assert c.call("check")["requests"] <= 1  # only the probe's first alloc, if it committed
    c.close()
    probe.close()


def test_a_corrupt_state_is_refused_at_start(procs, sock_dir, namespace):
    r = redis_or_skip()
    r.set(f"kvpool:{{{namespace}}}:snap", b"KVPOOL-STATE" + b"\0" * 40)
    r.set(f"kvpool:{{{namespace}}}:seq", 0)
    d = Daemon(procs, sock_dir, namespace)
    proc = procs([*CLI, "manager", "--config", str(d.config)], stderr=subprocess.PIPE)
    assert proc.wait(30) == 1
    err = proc.stderr.read()
    assert "refusing to serve a corrupt or partial state" in err and "checksum" in err, err


def test_a_killed_workers_blocks_come_back_within_the_session_timeout(procs, sock_dir, namespace):
    d = Daemon(procs, sock_dir, namespace, session_timeout_s=1.5)
    d.start()
    d.wait_active()
    holder = procs([*PROC, "holder", d.endpoint, "p"])
    assert '"holding"' in holder.stdout.readline()
    admin = ManagerClient(d.endpoint, role="admin", timeout_s=1.0)
    assert admin.stats()["pools"]["p"]["used_blocks"] > 0
    d.kill()  # the manager restarts too, meanwhile: the session survives it
    d.start()
    d.wait_active()
    os.kill(holder.pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: admin.stats()["pools"]["p"]["used_blocks"] == 0, 10, "the blocks to come back")
    assert time.monotonic() - t0 < 1.5 + 1.5  # the timeout plus one expiry check
    admin.call("check")
    admin.close()
