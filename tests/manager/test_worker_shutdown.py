"""A worker's SIGTERM while its durable manager is gone: bounded, and it says what it gave up (slow)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from helpers.durable import Daemon
from helpers.manager import CLI

from kvpool.client.generate import GenerateClient, WorkerUnavailable

pytestmark = pytest.mark.slow


def test_sigterm_with_the_durable_manager_unreachable_stops_within_seconds(procs, sock_dir, namespace):
    daemon = Daemon(procs, sock_dir, namespace)
    daemon.start()
    daemon.wait_active()
    endpoint = f"ipc://{sock_dir}/w.sock"
    worker = procs([*CLI, "worker", "--manager", daemon.endpoint, "--pool", "p", "--endpoint", endpoint,
                    "--model", "tiny", "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "4MiB",
                    "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = GenerateClient(endpoint)
    deadline = time.monotonic() + 60
    while True:  # until it serves
        assert worker.poll() is None and time.monotonic() < deadline
        try:
            client.call("ping", timeout_s=0.5)
            break
        except WorkerUnavailable:
            continue
    client.close()
    daemon.kill()  # durable: the worker would resend every call for failover_s (30 s) per call
    time.sleep(2.0)  # its heartbeat is in flight now
    t0 = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    took = time.monotonic() - t0
    assert took < 12, f"shutdown took {took:.1f}s"  # the client's 5 s timeout, twice at most
    err = worker.stderr.read()
    assert "not freed and the session not ended" in err or "gave up freeing" in err, err[-2000:]
