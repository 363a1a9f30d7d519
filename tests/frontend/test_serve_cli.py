"""`kvpool serve` as a user runs it: a process, curl-style HTTP, SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import httpx
import pytest

from kvpool.devcluster.cluster import DevCluster
from kvpool.shared.procs import CLI


def test_bad_options_say_what_to_write() -> None:
    out = subprocess.run(CLI + ["serve", "--tokenizer", "nopath"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "MODEL=PATH" in out.stderr
    out = subprocess.run(CLI + ["serve", "--policy", "random"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "kv-aware" in out.stderr


def start_door(manager: str) -> tuple[subprocess.Popen, str]:
    """`kvpool serve` on a free port, once its /health says a worker serves."""
    proc = subprocess.Popen(CLI + ["serve", "-m", manager, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = re.search(r"(http://\S+)/v1", proc.stdout.readline()).group(1)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the worker never showed up at the front door"
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        raise
    return proc, url


@pytest.mark.slow
def test_kvpool_serve_answers_http_and_stops_on_sigterm() -> None:
    cluster = DevCluster(prefix="kvpool-fd-")
    proc = None
    try:
        manager = cluster.manager()
        cluster.worker(manager, "p0")
        proc, url = start_door(manager)
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        cluster.stop()


def test_a_max_model_len_the_model_cannot_take_is_refused_before_it_loads(tmp_path) -> None:
    # vLLM's spelling: the model as the first argument; nothing listens at the manager
    out = subprocess.run(CLI + ["worker", "tiny", "--max-model-len", "100000", "-m", f"ipc://{tmp_path}/none.sock",
                                "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "max_position_embeddings: 2048" in out.stderr, out.stderr
    out = subprocess.run(CLI + ["worker", "tiny", "--model", "small"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "given twice" in out.stderr


@pytest.mark.slow
def test_vllms_worker_flags_a_served_name_and_the_models_own_length() -> None:
    cluster = DevCluster(prefix="kvpool-fd-")
    proc = None
    try:
        manager = cluster.manager()
        ep = cluster.worker(manager, "p0", extra=("--served-model-name", "my-tiny", "--gpu-memory-utilization", "0.8",
                                                  "-tp", "1", "--enable-prefix-caching"))
        cluster.wait_ready(cluster.workers[-1], ep, 120)
        proc, url = start_door(manager)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["my-tiny"]
        r = httpx.post(url + "/v1/completions", json={"model": "my-tiny", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4  # the preset's tokenizer
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 404  # the served name replaces the path, as in vLLM
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        cluster.stop()
