"""Attachments made with the attach op are part of the durable state (real Redis, real manager
processes): a manager killed and started again, and a standby that takes over, attach them
again; detach removes them for good. (The servers need not run: the mirror's health says so.)"""

from __future__ import annotations

import pytest
from helpers.durable import Daemon

from kvpool.client.manager import ManagerClient
from kvpool.shared.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.redis]
KEYS = ("name", "model", "url", "block_size", "topic", "events", "replay")


def spec(name: str) -> dict:
    port = free_port()
    return {"name": name, "model": "m", "url": f"http://127.0.0.1:{port}", "block_size": 32, "topic": name,
            "events": None, "replay": f"tcp://127.0.0.1:{port + 1}"}


def attached(endpoint: str) -> dict[str, dict]:
    with ManagerClient(endpoint, role="admin", timeout_s=10.0) as c:
        return {r["name"]: {k: r[k] for k in KEYS} for r in c.call("externals")["externals"]}


def daemon(procs, sock_dir, namespace, name: str) -> Daemon:
    return Daemon(procs, sock_dir, namespace, name=name, vllm_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                  vllm_metrics_poll_s=0.2)


def test_an_attachment_survives_a_kill_and_a_failover_and_a_detach_removes_it(procs, sock_dir, namespace):
    a, b = daemon(procs, sock_dir, namespace, "a"), daemon(procs, sock_dir, namespace, "b")
    a.start()
    a.wait_active()
    v0, v1 = spec("v0"), spec("v1")
    with ManagerClient(a.endpoint, role="admin", timeout_s=10.0) as c:
        c.call("attach", **v0)
        c.call("attach", **v1)
    assert attached(a.endpoint) == {"v0": v0, "v1": v1}
    b.start()  # a standby on the same namespace
    a.kill()  # SIGKILL: nothing but Redis remembers
    b.wait_active(60)
    assert attached(b.endpoint) == {"v0": v0, "v1": v1}  # attached again by the standby that took over
    with ManagerClient(b.endpoint, role="admin", timeout_s=10.0) as c:
        c.call("detach", name="v1")
        (row,) = c.call("externals")["externals"]
    assert row["stale"] is not None  # (no server runs there: it claims nothing)
    b.kill()
    a.start()  # the first one, started again
    a.wait_active(60)
    assert attached(a.endpoint) == {"v0": v0}
