"""`kvpool serve`'s layered settings: the managers list, whose env var separates managers with
';' because a comma already means one manager's failover endpoints."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvpool.frontend.serve_config import ServeConfig
from kvpool.shared.config import ConfigError, load
from kvpool.shared.procs import CLI

A, A2, B = "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", "ipc:///tmp/kvpool-node2.sock"  # loopback: no CURVE needed


def managers_from_env(value: str) -> tuple[str, ...]:
    cfg, source = load(ServeConfig, "frontdoor", env={"KVPOOL_FRONTDOOR_MANAGERS": value})
    assert source["managers"] == "env KVPOOL_FRONTDOOR_MANAGERS"
    return cfg.frontdoor_config().managers  # what the front door's directory splits per manager


@pytest.mark.parametrize(("value", "managers"), [
    (A, (A,)),
    (f"{A};{B}", (A, B)),
    (f" {A} ; {B} ;", (A, B)),
    (f"{A},{A2};", (f"{A},{A2}",)),  # one manager, its failover list
    (f"{A}, {A2};{B}", (f"{A},{A2}", B)),
])
def test_semicolons_separate_managers_and_commas_one_managers_failover_endpoints(value, managers):
    assert managers_from_env(value) == managers


@pytest.mark.parametrize("value", [f"{A},{B}", f"{A},{A2},{B}"])
def test_a_comma_list_without_a_semicolon_is_refused_as_ambiguous(value):
    with pytest.raises(ConfigError, match="ambiguous.*';'"):
        managers_from_env(value)


@pytest.mark.parametrize("value", [";", f"{A},,{A2};", f"{A} {B}"])
def test_an_empty_or_blank_endpoint_is_refused(value):
    with pytest.raises(ConfigError, match="KVPOOL_FRONTDOOR_MANAGERS|managers"):
        managers_from_env(value)


def test_a_file_list_keeps_one_item_per_manager_and_refuses_a_semicolon(tmp_path):
    f = tmp_path / "frontdoor.toml"
    f.write_text(f'[frontdoor]\nmanagers = ["{A},{A2}", "{B}"]\n')
    assert load(ServeConfig, "frontdoor", f, env={})[0].managers == [f"{A},{A2}", B]
    f.write_text(f'[frontdoor]\nmanagers = ["{A};{B}"]\n')
    with pytest.raises(ConfigError, match="one list item per manager"):
        load(ServeConfig, "frontdoor", f, env={})


def test_kvpool_config_show_and_serve_say_so():
    env = {**os.environ, "KVPOOL_FRONTDOOR_MANAGERS": f"{A},{A2};{B}"}
    out = subprocess.run([*CLI, "config", "show", "frontdoor"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"['{A},{A2}', '{B}']" in out.stdout
    env["KVPOOL_FRONTDOOR_MANAGERS"] = f"{A},{B}"
    out = subprocess.run([*CLI, "serve"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0 and "ambiguous" in out.stderr and "KVPOOL_FRONTDOOR_MANAGERS" in out.stderr
    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "KVPOOL_FRONTDOOR_MANAGERS" in " ".join(out.stdout.split())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "frontdoor.example"])
def test_listening_beyond_loopback_needs_an_api_key_or_an_explicit_allowance(host, tmp_path):
    with pytest.raises(ValueError, match="beyond loopback with no API key"):
        ServeConfig(host=host)
    assert ServeConfig(host=host, api_key="k").api_keys() == ["k"]
    assert ServeConfig(host=host, allow_unauthenticated=True).api_keys() == []
    keys = tmp_path / "keys"
    keys.write_text(" one \n")
    keys.chmod(0o600)
    assert ServeConfig(host=host, api_key="k", api_key_file=str(keys)).api_keys() == ["k", "one"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "localhost"])
def test_loopback_needs_no_key(host):
    assert ServeConfig(host=host).api_keys() == []


def test_an_unreadable_or_empty_key_file_and_bad_http_bounds_are_refused_with_the_field(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        ServeConfig(api_key_file=str(tmp_path / "missing")).api_keys()
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        ServeConfig(api_key_file=str(tmp_path / "empty")).api_keys()
    (tmp_path / "open").write_text("k\n")
    (tmp_path / "open").chmod(0o644)
    with pytest.raises(ValueError, match="readable by group or others"):
        ServeConfig(api_key_file=str(tmp_path / "open")).api_keys()
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServeConfig(header_timeout=0)
    with pytest.raises(ValueError, match="max_connections"):
        ServeConfig(max_connections=0)


def test_kvpool_api_key_reaches_the_config(tmp_path):
    out = subprocess.run([*CLI, "config", "show", "frontdoor", "--json"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVPOOL_FRONTDOOR_API_KEY": "from-env"})
    assert out.returncode == 0, out.stderr
    rows = {r["field"]: r for r in json.loads(out.stdout)}
    assert rows["api_key"] == {"field": "api_key", "value": "********", "source": "env KVPOOL_FRONTDOOR_API_KEY"}
