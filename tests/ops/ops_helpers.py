"""Factories for the operations tests: free ports, scraping, a manager in a thread, a daemon process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.metrics import parse_text
from kvpool.shared.protocol import block_bytes

SPEC = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
CLI = [sys.executable, "-c", "import sys; from kvpool.cli.main import cli; sys.exit(cli())"]
SHARED = list(range(1000, 1032))  # 32 tokens = 8 full blocks of 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_text(r.read().decode())


def value(metrics: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in metrics, f"no sample {name}{labels or ''} in the scrape"
    return metrics[key]


def sample(metrics: dict, name: str, **labels: str) -> float:
    """Like ``value``, 0.0 when there is no such sample yet (for polling)."""
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def kv_bytes(num_blocks: int) -> int:
    return num_blocks * block_bytes(SPEC)


def wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class ThreadServer:
    """A manager Server looping in a thread of this process."""

    def __init__(self, **cfg) -> None:
        self.server = Server(ManagerConfig(**cfg))
        self.endpoint = cfg["endpoint"]
        self.server.bind()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.request_stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "server thread did not stop"


def shared_prefix_allocs(rng, first_rid: int, n: int = 4) -> list[dict]:
    """``n`` alloc sub-ops whose prompts share the 32-token SHARED prefix."""
    from kvpool.shared.hashing import hash_blocks

    ops = []
    for rid in range(first_rid, first_rid + n):
        toks = SHARED + [rng.randrange(32000) for _ in range(rng.randint(1, 12))]
        ops.append({"op": "alloc", "req": rid, "hashes": hash_blocks(toks, 4), "prompt_len": len(toks),
                    "max_new": len(toks)})
    return ops


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it lingers; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout)


def apply(cached: set, events: list[dict]) -> None:
    """What a KV-aware router does with vLLM-format events (as ``decode_batch`` gives them)."""
    for ev in events:
        if ev["type"] == "BlockStored":
            cached.update(ev["block_hashes"])
        elif ev["type"] == "BlockRemoved":
            cached.difference_update(ev["block_hashes"])
        elif ev["type"] == "AllBlocksCleared":
            cached.clear()
