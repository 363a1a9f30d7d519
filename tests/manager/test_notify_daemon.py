"""A real daemon under a fake systemd: sd_notify datagrams, SIGHUP, health exit codes, JSON logs,
metrics (slow: real processes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest
from helpers.manager import CLI, free_port, scrape, value

from kvpool.client.manager import ManagerClient

pytestmark = pytest.mark.slow


def datagrams(sock: socket.socket, until: str, timeout: float = 30.0) -> list[str]:
    """Datagrams received until one holds the line ``until`` (inclusive)."""
    got, deadline = [], time.monotonic() + timeout
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(f"no {until!r} in {got}") from None
        got.append(msg)
        if until in msg.split("\n"):
            return got


def status(ep: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "status", "-m", ep, "--timeout", "2", *args], capture_output=True, text=True,
                          timeout=60)


def test_ready_watchdog_reload_health_and_stopping(procs, sock_dir):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"{sock_dir}/notify.sock")
    ep, port = f"ipc://{sock_dir}/m.sock", free_port()
    env = {**os.environ, "NOTIFY_SOCKET": f"{sock_dir}/notify.sock", "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    proc = procs([*CLI, "manager", "-m", ep, "--metrics-port", str(port), "--json-logs"], env=env,
                 stderr=subprocess.PIPE, text=True)
    client = ManagerClient(ep, identity="t", timeout_s=0.5)
    try:
        first = datagrams(notify, "READY=1")
        assert len(first) == 1 and first[0].startswith("READY=1\nSTATUS=serving " + ep), first
        client.hello()  # READY means the endpoint answers now
        t0 = time.monotonic()
        ticks = [d for d in datagrams(notify, "WATCHDOG=1") + datagrams(notify, "WATCHDOG=1") if d == "WATCHDOG=1"]
        assert len(ticks) >= 2 and time.monotonic() - t0 < 2.0  # every WATCHDOG_USEC / 2

        assert value(scrape(port), "kvpool_uptime_seconds") > 0
        healthy = status(ep, "--json")
        assert healthy.returncode == 0 and json.loads(healthy.stdout)["healthy"], healthy.stderr
        client.timeout_s = 5
        client.call("drain", enable=True)
        sick = status(ep)
        assert sick.returncode == 4 and "UNHEALTHY: draining" in sick.stdout
        client.call("drain", enable=False)
        proc.send_signal(signal.SIGHUP)  # reload (nothing to reload here): must not stop it
        time.sleep(0.3)
        assert proc.poll() is None and status(ep).returncode == 0
        client.close()

        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in datagrams(notify, "STOPPING=1")[-1]
        assert proc.wait(10) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert any(r["msg"].startswith("manager ") and "listening" in r["msg"] for r in logs)
        assert {"ts", "level", "logger", "msg"} <= set(logs[0])
        assert status(ep, "--timeout", "0.3").returncode == 3
    finally:
        client.close()
        notify.close()
