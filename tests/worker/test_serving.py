"""Multi-process: a manager daemon and worker processes over real sockets (slow)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from helpers.worker import make_prompt
from helpers.worker_procs import CLI, Cluster, ClusterConfig

from kvpool.client.generate import GenerateClient
from kvpool.client.manager import ManagerClient
from kvpool.worker.config import PRESETS
from kvpool.worker.model import build_model
from kvpool.worker.reference import reference_generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return build_model(PRESETS["tiny"], torch.float32, "cpu", seed=0)  # the workers' weights


@pytest.fixture
def cluster():
    c = Cluster(ClusterConfig(num_workers=1))
    try:
        c.start()
        yield c
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.procs)


def collect(client: GenerateClient, prompt, **params) -> tuple[list[list[int]], int]:
    outs: dict[int, list[int]] = {}
    messages = 0
    for msg in client.stream(prompt, timeout_s=30, **params):
        messages += 1
        if msg.token is not None:
            outs.setdefault(msg.index, []).append(msg.token)
    return [outs[i] for i in sorted(outs)], messages


def test_generate_streams_tokens_equal_to_reference(cluster, model):
    client = GenerateClient(cluster.worker_eps[0])
    try:
        prompt = make_prompt(45, 1)
        outs, messages = collect(client, prompt, max_tokens=12, ignore_eos=True)
        assert messages == 12  # one message per token
        assert outs == [reference_generate(model, prompt, 12)]
        outs, _ = collect(client, prompt, max_tokens=9, n=3, ignore_eos=True)  # fork after a hit
        assert outs == [reference_generate(model, prompt, 9)] * 3
        stats = client.call("stats")["stats"]
        assert stats["cached_tokens"] == 32 and stats["registrations"] == 1
        with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 512\)"):
            list(client.stream([5, 100_000], max_tokens=2))
        client.sock.send(b"\xc1 not msgpack")
        assert "error" in client.recv(5)
        assert client.call("ping")["pong"] == cluster.pools[0]  # still serving
    finally:
        client.close()
    out = subprocess.run(CLI + ["generate", "-w", cluster.worker_eps[0], "--max-tokens", "5", "--ignore-eos",
                                *map(str, prompt)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [int(t) for t in out.stdout.split()] == reference_generate(model, prompt, 5)


def test_after_manager_restart(cluster, model):
    client = GenerateClient(cluster.worker_eps[0])
    try:
        prompt = make_prompt(40, 2)
        assert collect(client, prompt, max_tokens=8)[0] == [reference_generate(model, prompt, 8)]
        manager = cluster.procs[0]
        manager.send_signal(signal.SIGKILL)
        manager.wait()
        cluster.start_manager()
        time.sleep(0.5)
        for p in (prompt, make_prompt(33, 3)):
            assert collect(client, p, max_tokens=8)[0] == [reference_generate(model, p, 8)]
        stats = client.call("stats")["stats"]
        assert stats["registrations"] == 2 and stats["resets"] == 1
    finally:
        client.close()


def test_sigterm_frees_everything_and_deregisters(cluster):
    client = GenerateClient(cluster.worker_eps[0])
    admin = ManagerClient(cluster.manager_ep, role="admin")
    try:
        rid = client.submit(make_prompt(60, 4), max_tokens=400, ignore_eos=True)
        while (msg := client.recv(10)) is not None and msg["id"] == rid and msg.get("token") is not None:
            if admin.stats()["pools"][cluster.pools[0]]["requests"] == 1:
                break  # running at the manager
        cluster.workers[0].send_signal(signal.SIGTERM)
        assert cluster.workers[0].wait(15) == 0
        last = None
        while (msg := client.recv(1)) is not None:
            last = msg
        assert last is not None and last["finished"] and last["reason"] == "abort"
        pool = admin.stats()["pools"][cluster.pools[0]]
        assert pool["requests"] == 0 and pool["used_blocks"] == 0
        assert admin.stats()["manager"]["sessions"] == 1  # only this admin session is left
    finally:
        client.close()
        admin.close()
