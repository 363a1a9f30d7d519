"""The admin CLI against a live server thread: tables, --json, exit codes."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner
from helpers.manager import SPEC, kv_bytes

from kvpool.cli.common import EXIT_UNREACHABLE
from kvpool.cli.main import cli
from kvpool.client.manager import ManagerClient


@pytest.fixture
def busy(live_server):
    """A server with pool "p" and a worker holding request 7 (3 blocks)."""
    live = live_server()
    worker = ManagerClient(live.endpoint, identity="worker-a")
    epoch = worker.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                            available_kv_bytes=kv_bytes(40))["epoch"]
    worker.step("p", epoch, [{"op": "alloc", "req": 7, "hashes": [], "prompt_len": 10, "max_new": 10}])
    yield live, worker, epoch
    worker.close()


def run(endpoint: str, *args: str, code: int = 0):
    res = CliRunner().invoke(cli, [*args], env={"KVPOOL_MANAGER": endpoint}, catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res.output


def test_status_pools_sessions_requests_as_tables_and_json(busy):
    live, _, _ = busy
    ep = live.endpoint
    assert json.loads(run(ep, "status", "--json"))["incarnation"] == live.server.incarnation
    assert "1 pools, 1 requests" in run(ep, "status")
    out = run(ep, "pools").splitlines()
    assert out[0].split() == ["POOL", "STATE", "HEALTH", "EPOCH", "SHARDS", "LIVE", "BLOCKS", "FREE", "CACHED",
                              "REQUESTS", "BLOCK_SIZE"]
    assert out[1].split() == ["p", "ready", "ok", "1", "1/1", "1/1", "40", "36", "0", "1", "4"]
    sessions = json.loads(run(ep, "sessions", "--json"))
    assert {s["identity"]: s["requests"] for s in sessions} == {"worker-a": 1, "kvpool-cli": 0}
    assert json.loads(run(ep, "requests", "-p", "p", "--json"))["requests"][0] | {} == {
        "session": 1, "identity": "worker-a", "req": 7, "num_tokens": 10, "blocks": 3, "cached_blocks": 0}
    assert "worker-a" in run(ep, "requests", "--pool", "p")
    stats = json.loads(run(ep, "stats", "--json"))
    assert stats["pools"]["p"]["used_blocks"] == 3 and stats["manager"]["ops"]["step"] == 1
    assert "HIT_RATE" in run(ep, "stats")
    assert live.server.registry.sessions.keys() == {busy[1].sid}  # the CLI's sessions ended


def test_pools_table_shows_each_host_tier_and_its_policy(busy):
    live, _, _ = busy
    other = ManagerClient(live.endpoint, identity="worker-b")
    try:
        other.register("q", shard_rank=0, shard_count=1, incarnation="j", spec=SPEC, available_kv_bytes=kv_bytes(40),
                       host_kv_bytes=kv_bytes(64), host_kv_policy="write_through")
        out = run(live.endpoint, "pools").splitlines()
        header = out[0].split()
        assert header[7:9] == ["HOST_CACHED", "HOST_POLICY"]
        rows = {line.split()[0]: line.split() for line in out[1:]}
        assert rows["p"][7:9] == ["-", "-"]  # no host tier
        assert rows["q"][7:9] == ["0/64", "write_through"]
    finally:
        other.close()


def test_errors_exit_1_with_the_managers_message(busy):
    live, _, _ = busy
    assert "unknown_pool" in run(live.endpoint, "requests", "-p", "nope", code=1)
    assert "in_use" in run(live.endpoint, "reset-cache", "-p", "p", code=1)


def test_drain_then_reset_then_shutdown(busy):
    live, worker, epoch = busy
    ep = live.endpoint
    assert json.loads(run(ep, "drain", "--no-wait", "--json")) == {"draining": True, "requests": 1}
    res = worker.step("p", epoch, [{"op": "alloc", "req": 8, "hashes": [], "prompt_len": 4, "max_new": 4},
                                   {"op": "free", "req": 7}])
    assert res[0]["code"] == "draining" and res[1]["ok"]
    assert "drained" in run(ep, "drain")
    assert "prefix cache reset" in run(ep, "reset-cache", "-p", "p")
    assert json.loads(run(ep, "drain", "--cancel", "--json"))["draining"] is False
    assert "shutting down" in run(ep, "shutdown")
    live.thread.join(10)
    assert not live.thread.is_alive()


def test_unreachable_manager_exits_3_with_a_hint(sock_dir):
    out = run(f"ipc://{sock_dir}/none.sock", "status", "--timeout", "0.3", code=EXIT_UNREACHABLE)
    assert "cannot reach the manager" in out and "kvpool manager" in out


def test_admin_key_is_required_when_configured(live_server):
    live = live_server(admin_key="k" * 12)
    assert "forbidden" in run(live.endpoint, "pools", code=1)
    assert run(live.endpoint, "pools", "--admin-key", "k" * 12).strip() == "(none)"


def test_manager_refuses_a_bad_config(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"session_timeout": 3}))
    out = run("ipc:///tmp/unused.sock", "manager", "--config", str(bad), code=1)
    assert "unknown keys ['session_timeout']" in out
    out = run("http://x", "manager", code=1)
    assert "ipc://PATH or tcp://HOST:PORT" in out


def test_drain_waits_until_the_last_request_is_freed(busy):
    live, worker, epoch = busy
    threading.Timer(0.6, lambda: worker.step("p", epoch, [{"op": "free", "req": 7}])).start()
    t0 = time.monotonic()
    assert json.loads(run(live.endpoint, "drain", "--json")) == {"draining": True, "requests": 0}
    assert time.monotonic() - t0 > 0.5


def test_stats_watch_refreshes_until_ctrl_c(busy, monkeypatch):
    live, _, _ = busy
    ticks = []

    def sleep(seconds: float) -> None:
        ticks.append(seconds)
        if len(ticks) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("kvpool.cli.admin.time.sleep", sleep)
    out = run(live.endpoint, "stats", "--watch", "--interval", "0.5", "--json").splitlines()
    assert ticks == [0.5, 0.5] and len(out) == 2
    assert [json.loads(line)["pools"]["p"]["requests"] for line in out] == [1, 1]
    assert live.server.registry.sessions.keys() == {busy[1].sid}


def test_evict_help_says_a_device_eviction_is_not_saved_to_the_host_tier():
    out = CliRunner().invoke(cli, ["evict", "--help"]).output
    assert "--tier device drops the blocks' hashes without saving them" in " ".join(out.split())
    assert "The host tier" in out


def test_evict_drops_free_cached_blocks_lru_first(busy):
    live, worker, epoch = busy
    from kvpool.shared.hashing import hash_blocks

    toks = list(range(12))  # three full blocks of 4
    res = worker.step("p", epoch, [{"op": "alloc", "req": 1, "hashes": hash_blocks(toks, 4), "prompt_len": 12,
                                    "max_new": 12}, {"op": "free", "req": 1}])
    assert res[0]["ok"] and res[1]["ok"]
    assert json.loads(run(live.endpoint, "evict", "-p", "p", "-n", "2", "--json")) == {"evicted": 2}
    # tail first: the chain keeps its head block only
    assert worker.lookup("p", hash_blocks(toks, 4)) == 1
    assert "1 cached blocks evicted" in run(live.endpoint, "evict", "--pool", "p", "--blocks", "5")
    assert worker.lookup("p", hash_blocks(toks, 4)) == 0


def test_bench_replays_the_reference_trace_in_process():
    res = CliRunner().invoke(cli, ["bench", "--requests", "400", "--blocks", "2000", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    full, bare = out["with_hashing"], out["allocate_free_only"]
    assert full["requests"] == bare["requests"] == 400
    assert full["prefix_hit_rate"] > 0.05 and bare["prefix_hit_rate"] == 0  # 30% share 128-token prefixes
    assert full["evictions"] > 0, "400 requests of ~18 blocks cycle through 2000 blocks"
    phases = full["cpu_us_hash"] + full["cpu_us_allocate"] + full["cpu_us_free"]
    assert full["cpu_us_hash"] > 0 and bare["cpu_us_hash"] == 0  # the bare run hashes nothing
    assert abs(phases - full["cpu_us_per_request"]) < 1e-6 * phases


@pytest.mark.parametrize("where", ["no-socket", "no-directory"])
def test_a_missing_manager_socket_is_said_at_once_and_status_json_still_answers(sock_dir, where):
    path = f"{sock_dir}/none.sock" if where == "no-socket" else f"{sock_dir}/gone/none.sock"
    t0 = time.monotonic()
    out = run(f"ipc://{path}", "status", "--timeout", "60", code=EXIT_UNREACHABLE)  # not waited out
    assert time.monotonic() - t0 < 30
    assert path in out and ("no socket there" if where == "no-socket" else "directory does not exist") in out
    res = CliRunner().invoke(cli, ["status", "--json", "--timeout", "60"], env={"KVPOOL_MANAGER": f"ipc://{path}"})
    assert res.exit_code == EXIT_UNREACHABLE
    report = json.loads(res.stdout)
    assert report["reachable"] is False and report["healthy"] is False and path in report["problems"][0]


def test_status_json_says_reachable_when_it_answers(busy):
    assert json.loads(run(busy[0].endpoint, "status", "--json"))["reachable"] is True
