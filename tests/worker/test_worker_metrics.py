"""`kvpool worker` from a TOML file + env + flags, serving Prometheus metrics, telling a fake
systemd when it is ready (slow: a real worker)."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from helpers.manager import (
    CLI,
    LiveServer,
    free_port,
    sample,
    scrape,
    stop_process,
    value,
    wait_until,
)

from kvpool.client.generate import GenerateClient, WorkerUnavailable

pytestmark = pytest.mark.slow
KV_BLOCKS = 64  # tiny preset, float32, block_size 16: 8 KiB per block over its 2 layers


def test_worker_metrics_move_with_generation(procs, sock_dir):
    manager = LiveServer(endpoint=f"ipc://{sock_dir}/m.sock")
    cfg = f"{sock_dir}/worker.toml"
    with open(cfg, "w") as f:
        f.write(f'[worker]\nmodel = "tiny"\npool = "w0"\ndtype = "float32"\ndevice = "cpu"\nmax_model_len = 256\n'
                f'kv_cache_memory = "{KV_BLOCKS * 8}KiB"\nthreads = 1\nendpoint = "ipc://{sock_dir}/w0.sock"\n')
    port = free_port()
    env_port = {"KVPOOL_WORKER_METRICS_PORT": str(port)}
    shown = subprocess.run([*CLI, "config", "show", "worker", "--config", cfg, "--json"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, **env_port})
    rows = {r["field"]: r for r in json.loads(shown.stdout)}
    assert rows["kv_cache_memory"]["value"] == KV_BLOCKS * 8192 and rows["pool"]["source"] == f"file {cfg}"
    assert rows["metrics_port"] == {"field": "metrics_port", "value": port,
                                    "source": "env KVPOOL_WORKER_METRICS_PORT"}
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"{sock_dir}/notify.sock")
    notify.settimeout(60)
    env = {**os.environ, **env_port, "OMP_NUM_THREADS": "1", "NOTIFY_SOCKET": f"{sock_dir}/notify.sock"}
    proc = procs([*CLI, "worker", "--config", cfg, "-m", manager.endpoint], env=env, stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE, text=True)
    client = GenerateClient(f"ipc://{sock_dir}/w0.sock")
    try:
        def ready() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return bool(client.call("ping", timeout_s=0.5))
            except WorkerUnavailable:
                return False

        assert notify.recv(4096).decode().startswith("READY=1\nSTATUS=pool w0: serving at ipc://")
        wait_until(ready, 60, "the worker to serve")
        prompt = list(range(2, 42))
        tokens = 0
        for p in (prompt, prompt[:32] + [7, 8, 9]):  # the second one hits the first's 32 cached tokens
            tokens += sum(m.token is not None for m in client.stream(p, max_tokens=10, ignore_eos=True))
        assert tokens == 20
        wait_until(lambda: sample(scrape(port), "kvpool_worker_generated_tokens_total", pool="w0") == tokens,
                   10, "a render after the last token")
        m = scrape(port)
        assert value(m, "kvpool_worker_kv_blocks_total", pool="w0") == KV_BLOCKS
        assert value(m, "kvpool_worker_cached_tokens_total", pool="w0") == 32
        assert value(m, "kvpool_worker_prompt_tokens_total", pool="w0") == len(prompt) + 35
        assert value(m, "kvpool_worker_requests_running", pool="w0") == 0
        assert value(m, "kvpool_worker_requests_waiting", pool="w0") == 0
        assert value(m, "kvpool_worker_preemptions_total", pool="w0") == 0
        assert value(m, "kvpool_worker_kv_usage_ratio", pool="w0") == 0
        assert value(m, "kvpool_worker_generation_tokens_per_second", pool="w0") > 0
        assert value(m, "kvpool_worker_step_latency_seconds_count", pool="w0") >= 10
        pool = manager.server.registry.pools["w0"].pool
        assert pool.stats.hit_tokens == 32  # the manager saw the same hit
    finally:
        client.close()
        rc = stop_process(proc)
        manager.stop()
    assert rc == 0, proc.stderr.read()
    assert notify.recv(4096) == b"STOPPING=1"
    notify.close()
