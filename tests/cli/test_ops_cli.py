"""`kvpool config show`, config validation, `kvpool status` health, log formats."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest
from click.testing import CliRunner
from helpers.manager import SPEC, LiveServer, kv_bytes

from kvpool.cli.main import cli
from kvpool.client.manager import ManagerClient
from kvpool.manager.config import ManagerConfig
from kvpool.shared.logs import JsonFormatter, OneLineFormatter


def run(*args: str, env: dict | None = None, code: int = 0) -> str:
    res = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res.output


def test_config_show_prints_each_value_and_its_source(tmp_path):
    f = tmp_path / "manager.toml"
    f.write_text('[manager]\nendpoint = "tcp://127.0.0.1:5555"\nsession_timeout_s = 4\nadmin_key = "s3cret-key"\n')
    env = {"KVPOOL_MANAGER_SESSION_TIMEOUT_S": "2.5", "KVPOOL_MANAGER_METRICS_PORT": "9500"}
    rows = {r["field"]: r for r in json.loads(run("config", "show", "manager", "--config", str(f), "--json", env=env))}
    assert rows["endpoint"] == {"field": "endpoint", "value": "tcp://127.0.0.1:5555", "source": f"file {f}"}
    assert rows["session_timeout_s"]["value"] == 2.5
    assert rows["session_timeout_s"]["source"] == "env KVPOOL_MANAGER_SESSION_TIMEOUT_S"
    assert rows["metrics_port"]["value"] == 9500 and rows["max_pools"]["source"] == "default"
    assert rows["admin_key"]["value"] == "********", "secrets are masked"
    assert rows["events_format"] == {"field": "events_format", "value": "vllm-0.33", "source": "default"}
    env11 = {**env, "KVPOOL_MANAGER_EVENTS_FORMAT": "vllm-0.11"}
    rows11 = {r["field"]: r for r in json.loads(run("config", "show", "manager", "--config", str(f), "--json",
                                                      env=env11))}
    assert rows11["events_format"]["value"] == "vllm-0.11"
    assert rows11["events_format"]["source"] == "env KVPOOL_MANAGER_EVENTS_FORMAT"
    table = run("config", "show", "manager", "--config", str(f), env=env).splitlines()
    assert table[0].split() == ["FIELD", "VALUE", "SOURCE"]
    assert "metrics_port            9500" in "\n".join(table)


@pytest.mark.parametrize(
    "toml, env, match",
    [
        ("[manager]\nmetrics_port = 70000\n", {}, "metrics_port must be a TCP port"),
        ("[manager]\nsession_timeout = 3\n", {}, r"unknown keys \['session_timeout'\]"),
        ("", {"KVPOOL_MANAGER_MAX_POOLS": "lots"}, "KVPOOL_MANAGER_MAX_POOLS='lots' is not a valid int"),
        ("[manager]\ncurve_secret_key_file = '/nonexistent/k'\n", {}, "needs both curve_secret_key_file"),
        ("[manager]\nevents_replay_endpoint = 'tcp://*:5558'\n", {}, "needs events_endpoint"),
        ("[manager]\nlog_level = 'loud'\n", {}, "log_level must be one of"),
        ("[manager]\nevents_format = 'vllm-0.9'\n", {}, "events_format must be one of vllm-0.33, vllm-0.11"),
        ("", {"KVPOOL_MANAGER_EVENTS_FORMAT": "msgpack"}, "events_format must be one of"),
    ],
)
def test_invalid_config_is_refused_with_what_to_change(tmp_path, toml, env, match):
    f = tmp_path / "m.toml"
    f.write_text(toml)
    out = run("config", "show", "manager", "--config", str(f), env=env, code=1)
    assert "manager config:" in out
    assert re.search(match, out), out
    out = run("manager", "--config", str(f), env=env, code=1)  # the daemon refuses the same way
    assert re.search(match, out), out


def test_events_format_flag_is_validated_by_the_config(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text("[manager]\n")
    out = run("manager", "--config", str(f), "--events-format", "vllm-0.9", code=1)
    assert "events_format must be one of vllm-0.33, vllm-0.11" in out


def test_worker_sizes_accept_units_in_files_and_env(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('[worker]\nkv_cache_memory = "64MiB"\n')
    rows = json.loads(run("config", "show", "worker", "--config", str(f), "--json",
                          env={"KVPOOL_WORKER_CPU_MEMORY_BUDGET": "1GiB"}))
    values = {r["field"]: r["value"] for r in rows}
    assert values["kv_cache_memory"] == 64 << 20 and values["cpu_memory_budget"] == 1 << 30
    assert "cannot parse a memory size" in run("config", "show", "worker", "--config", str(f),
                                               env={"KVPOOL_WORKER_CPU_MEMORY_BUDGET": "lots"}, code=1)


def test_from_file_keeps_the_manager_table_and_ignores_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "m.toml"
    f.write_text('[manager]\nendpoint = "tcp://127.0.0.1:5555"\n')
    monkeypatch.setenv("KVPOOL_MANAGER_MAX_POOLS", "3")
    cfg = ManagerConfig.from_file(str(f), session_timeout_s=2.0)
    assert (cfg.endpoint, cfg.session_timeout_s, cfg.max_pools) == ("tcp://127.0.0.1:5555", 2.0, 256)


def test_status_is_unhealthy_while_a_pool_waits_for_shards_or_a_pool_is_missing(sock_dir):
    live = LiveServer(endpoint=f"ipc://{sock_dir}/m.sock")
    w = ManagerClient(live.endpoint, identity="w")
    try:
        ep = ["-m", live.endpoint]
        assert "healthy" in run("status", *ep)
        out = run("status", *ep, "--pool", "a", code=4)
        assert "no pool a (its worker has not registered)" in out
        w.call("register", pool="a", shard_rank=0, shard_count=2, incarnation="x", spec=SPEC,
               available_kv_bytes=kv_bytes(16))
        body = json.loads(run("status", *ep, "--json", code=4))
        assert not body["healthy"] and body["problems"] == ["pools waiting for shards: a"]
    finally:
        w.close()
        live.stop()


def _record(msg: str, *args, exc: bool = False, **extra) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("kvpool.test", logging.WARNING, __file__, 1, msg, args, exc_info)
    rec.__dict__.update(extra)
    return rec


def test_log_records_are_one_line_plain_or_json():
    rec = _record("pool %s: %d blocks", "p", 7, exc=True, pool="p")
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["msg"] == "pool p: 7 blocks" and obj["level"] == "warning" and obj["logger"] == "kvpool.test"
    assert obj["pool"] == "p" and "ValueError: bad\nthing" in obj["exc"] and obj["ts"].endswith("Z")
    plain = OneLineFormatter().format(_record("a\nb", exc=True))
    assert "\n" not in plain and "WARNING kvpool.test: a\\nb" in plain
