"""Real processes on the real Redis: standby takeover, a paused old active fenced out, Redis
stopped and killed, a corrupt state refused, a killed worker's blocks coming back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.durable import (
    REDIS_URL,
    Daemon,
    LeaseWatch,
    call,
    durable_server,
    logged,
    redis_or_skip,
    seed_big_state,
)
from helpers.manager import CLI, HELPERS, SPEC, kv_bytes, wait_until

from kvpool.client.manager import ManagerClient
from kvpool.manager.store.base import StoreUnavailable
from kvpool.shared.procs import free_port
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


def first_answer(endpoint: str, timeout: float = 60.0) -> dict:
    """The first answer of a manager just started (a loaded machine may take seconds to run it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = raw(endpoint, "hello", None, timeout_s=0.5)
        if reply is not None:
            return reply
    raise AssertionError(f"no answer from {endpoint} in {timeout}s")


# After the lease lapses (Redis's clock), a standby polling every lease_ms / 5 takes it: a bound
# that a loaded machine (load 16 on 2 cores) holds with room; a standby that waited for anything
# longer (a session timeout, a 120 s loading lease) would not
TAKEOVER_SLACK_S = 10.0


def test_a_standby_takes_over_and_a_paused_old_active_is_fenced(procs, sock_dir, namespace):
    r = redis_or_skip()
    a = Daemon(procs, sock_dir, namespace, name="a")
    b = Daemon(procs, sock_dir, namespace, name="b")
    a.start()
    a.wait_active()
    b.start()
    assert first_answer(b.endpoint)["status"] == "not_active"  # b stands by
    c, epoch = worker([b.endpoint, a.endpoint])  # the standby first: the client moves on to a
    assert c.endpoint == a.endpoint
    first = c.step("p", epoch, ALLOC)[0]
    watch = LeaseWatch(r, namespace)
    try:
        os.kill(a.proc.pid, signal.SIGSTOP)  # the active one hangs (GC pause, VM freeze, partition)
        holder, token, ttl, now = watch.read()
        assert holder.endswith(a.endpoint) and 0 < ttl <= 1.0, (holder, ttl)  # a's lease lapses in lease_ms
        lapses = now + ttl
        t0 = time.monotonic()
        second = c.step("p", epoch, [{"op": "alloc", "req": 2, "hashes": [], "prompt_len": 10, "max_new": 10}])[0]
        takeover = time.monotonic() - t0
        taken = watch.holding(b.endpoint)
    finally:
        watch.stop()
    assert c.endpoint == b.endpoint and taken is not None
    b_token, b_at = taken
    assert int(b_token) == int(token) + 1  # b took the lease once, next after a
    # never before a's lease lapsed (5 ms: PTTL's millisecond), and promptly after it
    assert lapses - 0.005 <= b_at <= lapses + TAKEOVER_SLACK_S, (b_at - lapses)
    assert first["ok"] and second["ok"] and not set(first["blocks"]) & set(second["blocks"])
    os.kill(a.proc.pid, signal.SIGCONT)  # it wakes up: its next commit finds b's fencing token
    assert a.proc.wait(60) == 75
    rows = c.call("requests", pool="p", block_ids=True)["requests"]
    assert {r["req"]: r["block_ids"] for r in rows} == {1: first["blocks"], 2: second["blocks"]}
    c.call("check")
    c.close()
    print(f"standby took the lease {b_at - lapses:.2f}s after the hung one's lapsed (Redis's clock); the "
          f"client's step answered {takeover:.2f}s after the hang")


def test_a_standby_killed_while_loading_holds_the_lease_only_briefly(procs, sock_dir, namespace):
    """The lease is renewed in small steps while a state loads: a standby that dies mid-load
    stops renewing it, and the lease lapses within lease_ms (it once held 120 s), on Redis's
    own clock; the next standby takes it once it lapsed and serves."""
    r = redis_or_skip()
    # 16M blocks: about 5 s to load on a quiet core, well past a 2.5 s lease. A 1 s lease over 8M
    # blocks lapsed at load 16-20 while b was alive and loading: its renewal thread got no CPU
    # for two thirds of a second, which a loaded 2-core machine does to any process
    seed_big_state(namespace, 1 << 24)
    lease_s = 2.5
    b = Daemon(procs, sock_dir, namespace, name="b", lease_ms=int(lease_s * 1000))
    c = Daemon(procs, sock_dir, namespace, name="c", lease_ms=int(lease_s * 1000))
    b_log = Path(sock_dir) / "b.log"
    watch = LeaseWatch(r, namespace)
    try:
        b.start(log=b_log)
        wait_until(lambda: watch.holding(b.endpoint) is not None, 60, "b to take the lease")
        c.start()  # a standby beside the loading one

        def renewed_while_loading() -> bool:  # b's hold outlived one lease (Redis time) and b has not served
            assert not logged(b_log, " active: state"), "b finished loading before the test could kill it mid-load"
            holder, token, _, now = watch.read()
            assert not holder.endswith(c.endpoint), "c took the lease from b while b was loading"
            since = watch.first_seen.get((holder, token))
            return holder.endswith(b.endpoint) and since is not None and now > since + 1.1 * lease_s

        wait_until(renewed_while_loading, 60, "b to hold its lease past lease_ms while loading")
        b.kill()
        holder, _, ttl, now = watch.read()
        assert holder.endswith(b.endpoint) and ttl <= lease_s, (holder, ttl)  # lapses within lease_ms
        lapses = now + ttl
        c.wait_active(120)
        taken = watch.holding(c.endpoint)
    finally:
        watch.stop()
    assert not logged(b_log, " active: state")  # b died mid-load
    assert taken is not None and lapses - 0.005 <= taken[1] <= lapses + TAKEOVER_SLACK_S, (taken, lapses)
    assert raw(c.endpoint, "hello", None)["status"] == "ok"
    print(f"a standby killed mid-load: its lease lapsed {ttl:.2f}s later, the next one took it "
          f"{taken[1] - lapses:.2f}s after that (Redis's clock)")


def test_a_standby_whose_lease_poll_times_out_stands_by_and_is_not_fenced(namespace):
    """Under load a standby's poll of the lease can time out (Redis starved of a CPU): that is
    no lost lease. It once took itself for a fenced old active and exited 75 while the active
    one (killed mid-load) was only waiting for its lease to lapse."""
    redis_or_skip()
    # nothing renews the active's lease here (no loop runs): it must outlast this test's steps
    # on a loaded machine, where a 1 s lease lapsed between building the two servers
    cfg = {"redis_url": REDIS_URL, "namespace": namespace, "lease_ms": 30_000, "redis_timeout_s": 0.5}
    active = durable_server("ipc:///tmp/kvpool-failover-active.sock", **cfg)
    standby = durable_server("ipc:///tmp/kvpool-failover-standby.sock", **cfg)
    try:
        assert active.mode == "active" and standby.mode == "standby"
        acquire = standby.store.acquire

        def timed_out() -> bool:
            raise StoreUnavailable("TimeoutError: Timeout reading from socket")

        standby.store.acquire = timed_out
        standby._activate(time.monotonic())
        standby.store.acquire = acquire
        standby._activate(time.monotonic())  # the lease is still the active one's
        assert standby.mode == "standby" and standby.exit_code == 0 and not standby._stop
        assert call(standby, "hello")["status"] == "not_active"
    finally:
        active.close()
        standby.close()


def test_redis_stopped_then_killed_answers_errors_and_recovers(procs, sock_dir, namespace, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    port = free_port()
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
    wait_until(lambda: admin.stats()["pools"]["p"]["used_blocks"] == 0, 30, "the blocks to come back")
    # the timeout plus one expiry check, plus what a loaded machine (load 16, 2 cores) adds to the
    # manager's loop and this test's polling; far below the 30 s default timeout a lingering
    # session would be held to
    assert time.monotonic() - t0 < 1.5 + 1.5 + 5.0
    admin.call("check")
    admin.close()
