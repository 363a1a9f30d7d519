"""Factories for every test that talks to a manager: the base spec, one request through a
Server, a Server looping in a thread (``LiveServer``), metrics scraping, and the one way to
stop a process politely (``stop_process``; the ``procs`` fixture kills leftovers). A KV-event
subscriber folds events with ``kvpool.manager.event_client.CachedView``, one set per tier."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from helpers.kv_spec import SPEC
from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.metrics import parse_text
from kvpool.shared.procs import CLI, free_port  # noqa: F401 (the tests import them from here too)
from kvpool.shared.protocol import KVSpec, encode_request, unpack

SHARED = list(range(1000, 1032))  # 32 tokens = 8 full blocks of 4
HELPERS = Path(__file__).parent  # the process scripts: manager_procs.py, chaos_procs.py


def kv_bytes(num_blocks: int, spec: dict = SPEC) -> int:
    return num_blocks * KVSpec.from_wire(spec).block_bytes


def make_server(endpoint: str = "ipc:///tmp/kvpool-unused.sock", **cfg) -> Server:
    return Server(ManagerConfig(endpoint=endpoint, **cfg))


def call(srv: Server, op: str, sid: str | None = None, now: float | None = None, **args) -> dict:
    """One request through ``handle_payload`` (no socket); the decoded reply."""
    payload = encode_request(7, op, sid, args)
    return unpack(srv.handle_payload(payload, time.monotonic() if now is None else now))


def ok(reply: dict) -> dict:
    assert reply["status"] == "ok", reply
    return reply["body"]


def hello(srv: Server, **args) -> str:
    return ok(call(srv, "hello", **args))["sid"]


def register(srv: Server, sid: str, pool: str = "p", rank: int = 0, count: int = 1, inc: str = "i0",
             blocks: int = 64, spec: dict = SPEC) -> dict:
    """Registers a shard with the KV bytes of ``blocks`` blocks of the base SPEC."""
    return call(srv, "register", sid, pool=pool, shard_rank=rank, shard_count=count, incarnation=inc,
                spec=spec, available_kv_bytes=kv_bytes(blocks))


class LiveServer:
    """A Server looping in a thread of this process (the one thread-hosted server of the tests)."""

    def __init__(self, endpoint: str, **cfg) -> None:
        self.endpoint = endpoint
        self.server = Server(ManagerConfig(endpoint=endpoint, **cfg))
        self.server.bind()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.request_stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "server thread did not stop"


def wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


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
