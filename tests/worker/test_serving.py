"""Multi-process: a manager daemon and worker processes over real sockets (slow)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
import torch
from helpers.worker import make_prompt

from kvpool.worker.client import GenerateClient
from kvpool.worker.config import PRESETS
from kvpool.worker.demo import CLI, Cluster, DemoConfig, format_report, run_demo
from kvpool.worker.manager_client import ManagerClient
from kvpool.worker.model import build_model
from kvpool.worker.reference import reference_generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return build_model(PRESETS["tiny"], torch.float32, "cpu", seed=0)  # the workers' weights


@pytest.fixture
def cluster():
    c = Cluster(DemoConfig(num_workers=1))
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
        if msg["token"] is not None:
            outs.setdefault(msg["index"], []).append(msg["token"])
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


def test_demo_report():
    # 6 in flight: most requests are routed after the workers admitted earlier ones, so their
    # prefixes are cached in one pool (12 raced the workers' first admissions on a busy machine:
    # every system prompt could reach both pools uncached, and every later decision tied)
    cfg = DemoConfig(num_requests=24, max_inflight=6)
    r = run_demo(cfg, progress=False)
    assert r["requests"] == 24 and r["generated_tokens"] > 24 * cfg.max_tokens[0]
    assert 0 < r["prefix_hit_rate"] < 1
    assert r["routing"]["by_prefix"] + r["routing"]["by_load"] == 24 and r["routing"]["by_prefix"] > 0
    for p in r["pools"]:
        assert 0 < p["peak_blocks"] < p["static_blocks"]
    out = subprocess.run(CLI + ["demo", "--requests", "8", "--json"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "tokens_per_s" in out.stdout
    text = format_report(r)
    for figure in ("tokens/s", "prefix-cache hits", "preemptions", "routing", "peak ... blocks"):
        assert f"\n  {figure}" in text, f"the report explains {figure}"


def test_demo_says_what_starts_and_stops_at_once_on_ctrl_c():
    p = subprocess.Popen(CLI + ["demo", "--requests", "5000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)  # its own group: a failure kills its children too
    try:
        first = p.stderr.readline()
        assert first.startswith("starting a manager") and "seeded random weights" in first, first
        assert "waiting for the workers" in p.stderr.readline()
        assert p.stderr.readline().startswith("ready in")
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert p.wait(15) == 130
        assert time.monotonic() - t0 < 10
        rest = p.stderr.read()
        assert "Traceback" not in rest
        lines = [ln for ln in rest.replace("\r", "\n").splitlines() if ln.strip() and "/s]" not in ln
                 and "requests" not in ln and "?" not in ln]
        assert lines == ["interrupted: the demo's manager and workers are stopped"], lines
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
