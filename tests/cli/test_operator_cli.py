"""Operator edges of the CLI, in process: events without a publisher, keygen's default
directory, snapshot/restore needing a Redis, generate's argument ranges, presets' help."""

from __future__ import annotations

import os
import threading
import time

import pytest
from click.testing import CliRunner
from helpers.manager import SPEC, kv_bytes

from kvpool.cli.main import cli
from kvpool.client.manager import ManagerClient
from kvpool.shared.hashing import hash_blocks


def run(*args: str, env: dict | None = None, code: int = 0) -> str:
    res = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res.output


@pytest.fixture
def server(live_server):
    return live_server


def test_events_says_at_once_that_the_manager_publishes_none(server):
    live = server()
    t0 = time.monotonic()
    out = run("events", "-m", live.endpoint, code=1)
    assert "publishes no KV events" in out and "--events-endpoint" in out and time.monotonic() - t0 < 5
    out = run("events", "-m", "ipc:///nonexistent/m.sock", code=3)
    assert "cannot reach the manager" in out and "--endpoint" in out


def test_events_finds_the_publisher_through_the_manager(server, sock_dir):
    live = server(events_endpoint=f"ipc://{sock_dir}/ev.sock")
    worker = ManagerClient(live.endpoint)
    epoch = worker.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                            available_kv_bytes=kv_bytes(64))["epoch"]
    done = threading.Event()

    def publish() -> None:  # until the subscriber has seen one (it joins at some point)
        rid = 0
        while not done.is_set():
            toks = [rid % 100 + 1] * 8
            worker.step("p", epoch, [{"op": "alloc", "req": rid, "hashes": hash_blocks(toks, 4), "prompt_len": 9,
                                      "max_new": 9}, {"op": "free", "req": rid}])
            rid += 1
            time.sleep(0.1)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        out = run("events", "-m", live.endpoint, "--count", "1")
        assert " p [vllm-0.33]: stored " in out
    finally:
        done.set()
        thread.join(5)
        worker.close()


def test_keygen_writes_to_the_current_directory_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run("keygen", "--name", "w1")
    assert sorted(os.listdir(tmp_path)) == ["w1.key", "w1.key_secret"]


def test_snapshot_and_restore_need_a_redis_url_or_take_the_managers(tmp_path):
    env = {"KVPOOL_REDIS_URL": None, "KVPOOL_MANAGER_REDIS_URL": None}
    assert "pass --redis-url" in run("snapshot", "-o", str(tmp_path / "s.kvps"), env=env, code=2)
    (tmp_path / "s.kvps").write_bytes(b"")
    assert "pass --redis-url" in run("restore", str(tmp_path / "s.kvps"), env=env, code=2)
    cfg = tmp_path / "manager.toml"
    cfg.write_text('[manager]\nredis_url = "redis://127.0.0.1:1/3"\nnamespace = "ns-from-config"\n')
    out = run("snapshot", "--config", str(cfg), env=env, code=1)
    assert "namespace 'ns-from-config' from redis://127.0.0.1:1/3" in out


@pytest.mark.parametrize("args, match", [
    (["-n", "0", "5"], "0 is not in the range 1<=x<=256"),
    (["18446744073709551616"], "is not in the range 0<=x<=4294967295"),
    (["--seed", "18446744073709551616", "5"], "is not in the range"),
    (["--max-tokens", "0", "5"], "is not in the range"),
])
def test_generate_refuses_out_of_range_numbers_with_a_message(args, match):
    out = run("generate", *args, code=2)
    assert match in out and "Traceback" not in out


def test_presets_say_they_have_seeded_random_weights():
    assert "seeded random weights" in " ".join(run("worker", "--help").split())


def test_dropping_a_pool_tells_event_subscribers_to_clear_it(server, sock_dir):
    import zmq

    from kvpool.manager.events import decode_batch

    live = server(events_endpoint=f"ipc://{sock_dir}/ev2.sock")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{sock_dir}/ev2.sock")
    worker = ManagerClient(live.endpoint)
    try:
        epoch = worker.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                                available_kv_bytes=kv_bytes(64))["epoch"]
        rid = 0
        while not sub.poll(200):  # until the subscription is joined and a batch arrives
            toks = [rid + 1] * 8
            worker.step("p", epoch, [{"op": "alloc", "req": rid, "hashes": hash_blocks(toks, 4), "prompt_len": 9,
                                      "max_new": 9}])
            rid += 1
        while sub.poll(300):
            sub.recv_multipart()
        out = run("drop-pool", "p", "--force", env={"KVPOOL_MANAGER": live.endpoint})
        assert f"({rid} requests freed)" in out
        assert sub.poll(5000)
        topic, _, payload = sub.recv_multipart()
        events = decode_batch(payload).events
        assert topic == b"p" and len(events) == 1 and "AllBlocksCleared" in str(events[0])
        assert live.server.registry.pools == {}
    finally:
        worker.close()
        sub.close()
        ctx.term()
