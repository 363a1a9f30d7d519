"""Factories for the manager tests (a uniquely named module: several test folders have a conftest)."""

from __future__ import annotations

import sys
import threading
import time

from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.protocol import KVSpec, encode_request, unpack

SPEC = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
CLI = [sys.executable, "-c", "from kvpool.cli.main import cli; cli()"]


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
    """A Server looping in a thread of this process."""

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
