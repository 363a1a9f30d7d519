"""The front door as a CURVE client: of a real manager and a real worker that both run CURVE.

Keys that match are served; a key the worker does not allow, or no CURVE at all, is a 503 naming
the reason (and a log line) at once, never a hang. Non-loopback TCP without CURVE is refused
unless --insecure; the keys come from options or the [frontdoor] config file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import time

import httpx
import pytest

from kvpool.frontend.directory import Directory
from kvpool.frontend.procs import CLI, LocalCluster
from kvpool.frontend.serve_config import ServeConfig
from kvpool.frontend.server import FrontDoorServer
from kvpool.frontend.service import FrontDoorConfig
from kvpool.shared.curve import ClientKeys, write_keypair

PROMPT = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "ignore_eos": True}


def front_door(manager: str, keys: dict, name: str, worker_curve: bool = True) -> FrontDoorServer:
    own = str(keys[name][1])
    cfg = FrontDoorConfig((manager,), poll_s=0.2, manager_keys=ClientKeys.load(str(keys["manager"][0]), own),
                          worker_keys=ClientKeys.load(str(keys["worker"][0]), own) if worker_curve else None)
    return FrontDoorServer(cfg).start()


def known_worker(fd: FrontDoorServer, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fd.frontdoor.directory.workers:
        assert time.monotonic() < deadline, "the manager never announced the worker"
        time.sleep(0.05)


@pytest.mark.slow
def test_front_door_serves_a_curve_worker_and_says_why_one_refuses_it(tmp_path, caplog):
    keys = {n: write_keypair(tmp_path, n) for n in ("manager", "worker", "front", "stranger")}
    manager_allowed, worker_allowed = tmp_path / "manager-allowed", tmp_path / "worker-allowed"
    manager_allowed.mkdir()
    worker_allowed.mkdir()
    for n in ("worker", "front", "stranger"):  # the manager lets the stranger in: the worker refuses it
        shutil.copy(keys[n][0], manager_allowed)
    shutil.copy(keys["front"][0], worker_allowed)
    cluster = LocalCluster()
    doors: list[FrontDoorServer] = []
    try:
        manager = cluster.manager("manager", "--curve-secret-key-file", str(keys["manager"][1]),
                                  "--curve-allowed-keys-dir", str(manager_allowed))
        cluster.worker(manager, "w0", extra=(
            "--curve-server-key", str(keys["manager"][0]), "--curve-key-file", str(keys["worker"][1]),
            "--curve-secret-key-file", str(keys["worker"][1]), "--curve-allowed-keys-dir", str(worker_allowed)))
        good = front_door(manager, keys, "front")
        doors.append(good)
        good.wait_for_workers("tiny", 1, timeout_s=90)
        r = httpx.post(good.url + "/v1/completions", json=PROMPT, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

        caplog.set_level(logging.WARNING, logger="kvpool.client.generate_async")
        for name, worker_curve, reason in (("stranger", True, "refused this front door's CURVE key"),
                                           ("front", False, "the worker runs CURVE and this front door does not")):
            fd = front_door(manager, keys, name, worker_curve)
            doors.append(fd)
            known_worker(fd)  # the manager serves it: only the worker refuses
            t0 = time.monotonic()
            r = httpx.post(fd.url + "/v1/completions", json=PROMPT, timeout=60)
            assert time.monotonic() - t0 < 10  # at once, not after the silence timeout
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert reason in err["message"] and err["type"] == "service_unavailable", err
            assert any(reason in rec.getMessage() for rec in caplog.records), caplog.text
            health = httpx.get(fd.url + "/health", timeout=10)
            assert health.status_code == 503 and reason in health.json()["unreachable"]["w0"]
        r = httpx.post(good.url + "/v1/completions", json=PROMPT, timeout=60)  # the good one is unharmed
        assert r.status_code == 200
    finally:
        for fd in doors:
            fd.stop()
        cluster.stop()


def test_non_loopback_tcp_without_curve_is_refused_unless_insecure():
    with pytest.raises(ValueError, match="--insecure"):
        FrontDoorConfig(("tcp://10.1.2.3:5555",))
    with pytest.raises(ValueError, match="--insecure"):
        FrontDoorConfig(("ipc:///tmp/a.sock,tcp://manager.example:5555",))  # a failover endpoint too
    assert FrontDoorConfig(("tcp://10.1.2.3:5555",), insecure=True).insecure
    assert FrontDoorConfig(("tcp://127.0.0.1:5555", "ipc:///tmp/m.sock")).managers


def test_a_worker_announced_on_the_network_is_not_connected_to_without_curve(tmp_path):
    keys = write_keypair(tmp_path, "worker"), write_keypair(tmp_path, "front")
    row = {"pool": "w", "model": "tiny", "endpoint": "tcp://10.1.2.3:7000", "max_model_len": 64, "block_size": 16,
           "num_blocks": 8, "free_blocks": 8, "epoch": 1}

    async def link_lost(worker_keys: ClientKeys | None, insecure: bool) -> str | None:
        d = Directory(["ipc:///nonexistent/m.sock"], worker_keys=worker_keys, insecure=insecure)
        try:
            await d._apply(0, [row])  # what a refresh does with the manager's `workers` rows
            assert (d.serving("tiny") == []) == (d.workers[(0, "w")].link.lost is not None)
            return d.workers[(0, "w")].link.lost
        finally:
            await d.close()

    refused = asyncio.run(link_lost(None, False))
    assert refused is not None and "--insecure" in refused and "tcp://10.1.2.3:7000" in refused
    assert asyncio.run(link_lost(None, True)) is None
    assert asyncio.run(link_lost(ClientKeys.load(str(keys[0][0]), str(keys[1][1])), False)) is None


def test_serve_takes_its_keys_from_the_config_file(tmp_path):
    keys = {n: write_keypair(tmp_path, n) for n in ("manager", "worker", "front")}
    path = tmp_path / "frontdoor.toml"
    path.write_text(f'[frontdoor]\nmanagers = ["tcp://10.1.2.3:5555"]\nport = 0\n'
                    f'curve_server_key = "{keys["manager"][0]}"\ncurve_key_file = "{keys["front"][1]}"\n'
                    f'worker_curve_key = "{keys["worker"][0]}"\n')
    out = subprocess.run(CLI + ["config", "show", "frontdoor", "--config", str(path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"file {path}" in {r["field"]: r["source"] for r in json.loads(out.stdout)}["worker_curve_key"]
    from kvpool.shared.config import load

    cfg, _ = load(ServeConfig, "frontdoor", path, env={})
    fd_cfg = cfg.frontdoor_config()  # the non-loopback manager is accepted: CURVE is on
    assert fd_cfg.manager_keys.public == fd_cfg.worker_keys.public  # one identity, both sockets
    assert fd_cfg.worker_keys.server_public != fd_cfg.manager_keys.server_public
    path.write_text('[frontdoor]\nmanagers = ["tcp://10.1.2.3:5555"]\nport = 0\n')
    out = subprocess.run(CLI + ["serve", "--config", str(path)], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and "CURVE is off" in out.stderr and "--insecure" in out.stderr
    out = subprocess.run(CLI + ["serve", "--config", str(path), "--worker-curve-key", str(keys["worker"][0])],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and "--curve-key-file" in out.stderr
