"""CURVE on the worker's generate socket, through a real worker process (slow)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest
import torch
from helpers.worker import make_prompt
from helpers.worker_procs import CLI, Cluster, ClusterConfig

from kvpool.client.generate import GenerateClient, WorkerUnavailable
from kvpool.shared.curve import ClientKeys, write_keypair
from kvpool.worker.config import PRESETS
from kvpool.worker.model import build_model
from kvpool.worker.reference import reference_generate

pytestmark = pytest.mark.slow


def test_a_curve_worker_serves_allowed_keys_and_refuses_the_others(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    keys = {name: write_keypair(tmp_path, name) for name in ("worker", "front", "stranger")}
    shutil.copy(keys["front"][0], allowed)
    cluster = Cluster(ClusterConfig(num_workers=1))
    clients: list[GenerateClient] = []
    front = ClientKeys.load(str(keys["worker"][0]), str(keys["front"][1]))
    try:
        cluster.start(worker_args=("--curve-secret-key-file", str(keys["worker"][1]),
                                   "--curve-allowed-keys-dir", str(allowed)), curve=front)
        worker, ep = cluster.workers[0], cluster.worker_eps[0]
        good = GenerateClient(ep, curve=front)
        clients.append(good)
        assert good.call("ping")["pong"] == cluster.pools[0]
        prompt = make_prompt(20, 3)
        tokens = [m.token for m in good.stream(prompt, timeout_s=30, max_tokens=5, ignore_eos=True)]
        model = build_model(PRESETS["tiny"], torch.float32, "cpu", seed=0)
        assert tokens == reference_generate(model, prompt, 5)
        stranger = GenerateClient(ep, curve=ClientKeys.load(str(keys["worker"][0]), str(keys["stranger"][1])))
        plain = GenerateClient(ep)
        clients += [stranger, plain]
        for refused in (stranger, plain):
            with pytest.raises(WorkerUnavailable):
                refused.call("ping", timeout_s=1.0)
        out = subprocess.run(CLI + ["generate", "-w", ep, "--max-tokens", "5", "--ignore-eos", "--worker-key",
                                    str(keys["worker"][0]), "--curve-key-file", str(keys["front"][1]),
                                    *map(str, prompt)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert [int(t) for t in out.stdout.split()] == tokens
        shutil.copy(keys["stranger"][0], allowed)  # allowed from now on: SIGHUP re-reads the directory
        worker.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        welcome = GenerateClient(ep, curve=ClientKeys.load(str(keys["worker"][0]), str(keys["stranger"][1])))
        clients.append(welcome)
        assert welcome.call("ping", timeout_s=10)["pong"] == cluster.pools[0]
        assert good.call("ping")["pong"] == cluster.pools[0] and worker.poll() is None
    finally:
        for c in clients:
            c.close()
        cluster.stop()
