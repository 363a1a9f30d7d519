"""An operator's day through real processes: a manager, workers and `kvpool` commands (slow).

Every failure answers fast and names its cause; nothing hangs, nothing takes a live worker's
pool silently, nothing registers memory the machine does not have."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

import pytest
from helpers.worker import make_prompt

from kvpool.client.generate import GenerateClient
from kvpool.client.manager import ManagerClient
from kvpool.devcluster.cluster import ClusterConfig, DevCluster
from kvpool.shared.procs import CLI

pytestmark = pytest.mark.slow


class OpsCluster(DevCluster):
    """The test cluster with a short session timeout (a dead worker is seen in ~1.5 s)."""

    def start_manager(self) -> subprocess.Popen:
        return self.spawn(["manager", "--manager", self.manager_ep, "--session-timeout", "1.5"], "manager")


@pytest.fixture
def cluster():
    c = OpsCluster(ClusterConfig(num_workers=1, max_model_len=1024, kv_blocks=80))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def kvpool(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def worker_args(c: DevCluster, *extra: str) -> list[str]:
    return ["worker", "--manager", c.manager_ep, "--model", "tiny", "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "1024", "--threads", "1", "--kv-cache-memory", "4MiB", *extra]


def pool_row(c: DevCluster) -> dict | None:
    rows = json.loads(kvpool("pools", "-m", c.manager_ep, "--json").stdout)
    return next((r for r in rows if r["pool"] == c.pools[0]), None)


def worker_stats(endpoint: str) -> dict:
    client = GenerateClient(endpoint)
    try:
        return client.call("stats")["stats"]
    finally:
        client.close()


def wait_for(pred, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def long_generate(c: DevCluster, *extra: str) -> subprocess.Popen:
    """A 1,000-token `kvpool generate` that takes Ctrl-C as a terminal's client would: a suite
    started in the background by a shell without job control (`cmd &` in a script, some CI
    runners) ignores SIGINT, and its children inherit that; a handler set here is reset to the
    default in the child at exec, so Python there turns SIGINT into KeyboardInterrupt again."""
    prompt = map(str, make_prompt(20, 7))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([*CLI, "generate", "-w", c.worker_eps[0], "--max-tokens", "1000", "--ignore-eos",
                                 *extra, *prompt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, old)


def test_refusals_come_before_anything_is_registered(cluster):
    c = cluster
    t0 = time.monotonic()
    out = kvpool(*worker_args(c, "--pool", c.pools[0], "--endpoint", c.worker_eps[0]))
    assert out.returncode == 1 and "already serves" in out.stderr and "--replace" in out.stderr
    assert time.monotonic() - t0 < 20
    other = f"ipc://{c.dir}/other.sock"
    out = kvpool(*worker_args(c, "--pool", c.pools[0], "--endpoint", other))
    assert out.returncode == 1 and "not_owner" in out.stderr and "kvpool worker --replace" in out.stderr
    out = kvpool(*worker_args(c, "--pool", "big", "--endpoint", other, "--kv-cache-memory", "1TiB"))
    assert out.returncode == 1 and "1024.00 GiB" in out.stderr and "--kv-cache-memory" in out.stderr
    assert pool_row(c)["health"] == "ok" and "big" not in kvpool("pools", "-m", c.manager_ep).stdout
    xdg = tempfile.mkdtemp(prefix="kvp-")
    t0 = time.monotonic()
    out = kvpool("generate", "--pool", "nope", "-m", c.manager_ep, "5", "6", env={"XDG_RUNTIME_DIR": xdg})
    assert out.returncode == 3 and time.monotonic() - t0 < 10
    assert "socket file does not exist" in out.stderr and "knows no pool 'nope'" in out.stderr


def test_truncation_ctrl_c_and_a_worker_killed_mid_generation(cluster):
    c = cluster
    prompt = [str(t) for t in make_prompt(20, 8)]
    out = kvpool("generate", "-w", c.worker_eps[0], "--max-tokens", "5000", "--ignore-eos", *prompt)
    assert out.returncode == 0 and len(out.stdout.split()) == 1024 - 20
    assert "finished: length (cut at the worker's max_model_len after 1004 of 5000 tokens)" in out.stderr
    gen = long_generate(c)
    wait_for(lambda: worker_stats(c.worker_eps[0])["running"] == 1, what="the request to run")
    # the worker is held still, so the request cannot end before the interrupt reaches the client
    # (at load 15 its 1,000 tokens were done between the poll above and the signal)
    c.workers[0].send_signal(signal.SIGSTOP)
    try:
        gen.send_signal(signal.SIGINT)
        assert gen.wait(30) == 130  # under 0.4 s at load 15 (the 30 s is a bound, not a target)
    finally:
        c.workers[0].send_signal(signal.SIGCONT)
    err = gen.stderr.read()
    assert "interrupted: the request was aborted" in err and "Traceback" not in err
    wait_for(lambda: worker_stats(c.worker_eps[0])["running"] == 0, 5, "the worker to abort it")
    gen = long_generate(c)
    wait_for(lambda: worker_stats(c.worker_eps[0])["running"] == 1, what="the request to run")
    c.workers[0].send_signal(signal.SIGSTOP)  # mid-generation for certain, as above
    c.workers[0].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert gen.wait(10) == 3 and time.monotonic() - t0 < 5
    assert "went away" in gen.stderr.read()
    t0 = time.monotonic()
    out = kvpool("generate", "-w", c.worker_eps[0], "5", "6")  # its socket file is left behind
    assert out.returncode == 3 and "stale socket file" in out.stderr and time.monotonic() - t0 < 10
    wait_for(lambda: kvpool("status", "-m", c.manager_ep, "--pool", c.pools[0]).returncode == 4, 10,
             "the dead worker's session to expire")
    assert "worker died" in kvpool("status", "-m", c.manager_ep).stdout
    assert kvpool("drop-pool", "-m", c.manager_ep, c.pools[0]).returncode == 0
    assert kvpool("status", "-m", c.manager_ep).returncode == 0


def test_drain_backs_off_and_a_replacement_worker_takes_over_only_when_asked(cluster):
    c = cluster
    assert kvpool("drain", "-m", c.manager_ep, "--no-wait").returncode == 0
    admin = ManagerClient(c.manager_ep, role="admin", identity="test")  # a call per second keeps it alive
    try:
        gen = long_generate(c)
        steps0 = admin.stats()["manager"]["ops"].get("step", 0)
        t0 = time.monotonic()
        while gen.poll() is None and time.monotonic() - t0 < 15:
            admin.heartbeat()
            time.sleep(0.3)
        assert gen.wait(1) == 3 and time.monotonic() - t0 < 10  # the process starts, then a heartbeat says why
        assert "the manager is draining" in gen.stderr.read()
        time.sleep(1.0)
        steps = admin.stats()["manager"]["ops"].get("step", 0) - steps0
        assert steps < 30, f"{steps} step messages while draining"  # before the back-off: thousands
        stats = worker_stats(c.worker_eps[0])
        assert stats["waiting"] == 0 and stats["running"] == 0  # the abandoned request is dropped
        assert kvpool("drain", "-m", c.manager_ep, "--cancel").returncode == 0
        # --replace: the new worker binds the same socket; the old one sees it and leaves
        new = subprocess.Popen([*CLI, *worker_args(c, "--pool", c.pools[0], "--endpoint", c.worker_eps[0],
                                                   "--replace")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
        try:
            assert c.workers[0].wait(60) == 0
            c.wait_ready(new, c.worker_eps[0], 30)
            row = pool_row(c)
            assert row["health"] == "ok" and row["epoch"] == 2 and row["live_shards"] == 1
            out = kvpool("generate", "-w", c.worker_eps[0], "--max-tokens", "3", "5", "6", "7")
            assert out.returncode == 0 and len(out.stdout.split()) == 3 and "finished: length" in out.stderr
            gen = long_generate(c)  # stopped mid-generation: not a success
            wait_for(lambda: worker_stats(c.worker_eps[0])["running"] == 1, what="the request to run")
            new.send_signal(signal.SIGSTOP)  # held mid-generation until SIGTERM is pending (as above)
            new.send_signal(signal.SIGTERM)
            new.send_signal(signal.SIGCONT)
            assert new.wait(15) == 0
            assert gen.wait(10) == 1 and "finished: abort (the worker stopped the request" in gen.stderr.read()
        finally:
            if new.poll() is None:
                new.kill()
        assert not os.path.exists(c.worker_eps[0][len("ipc://"):])  # its socket file is removed
        assert pool_row(c)["health"] == "idle"
        assert kvpool("status", "-m", c.manager_ep).returncode == 0
    finally:
        admin.close()
