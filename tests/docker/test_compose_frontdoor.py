"""The compose file's front door, its keys and its images: checked with what exists here (no
Docker engine): the YAML, the real CLI and config classes, and the keys step's script run for real."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvpool.frontend.serve_config import ServeConfig
from kvpool.shared.config import load

ROOT = Path(__file__).resolve().parents[2]
yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")


def services() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]


def test_front_door_service_serves_over_the_workers_with_an_http_healthcheck():
    s = services()
    fd = s["frontdoor"]
    assert fd["command"][0] == "serve" and fd["depends_on"]["manager"]["condition"] == "service_healthy"
    assert {"worker-0", "worker-1"} <= set(fd["depends_on"])
    cfg_path = fd["command"][fd["command"].index("--config") + 1]
    assert cfg_path == "/etc/kvpool/frontdoor.toml"
    assert "COPY docker/config/frontdoor.toml /etc/kvpool/frontdoor.toml" in \
        (ROOT / "docker" / "Dockerfile.manager").read_text()
    cfg, _ = load(ServeConfig, "frontdoor", ROOT / "docker" / "config" / "frontdoor.toml", env={})
    test = fd["healthcheck"]["test"]
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\S*?)'", test[-1])
    assert test[0] == "CMD" and url and int(url.group(1)) == cfg.port and url.group(2) == "/health"
    published = [p for p in fd["ports"] if p.endswith(f":{cfg.port}")]
    assert published and published[0].startswith("127.0.0.1:"), "the HTTP API is published on loopback only"
    assert cfg.host == "0.0.0.0"  # reachable from the published port inside the container
    # beyond loopback the packaged config requires an API key, from a file on the keys volume
    assert cfg.api_key_file and cfg.api_key_file.startswith("/keys/") and not cfg.allow_unauthenticated
    assert "kvpool-keys:/keys:ro" in fd["volumes"]


def test_every_kvpool_variable_in_compose_names_a_real_field_or_option():
    from kvpool.cli.layered import service_class
    from kvpool.cli.main import cli

    envvars = {p.envvar for cmd in cli.commands.values() for p in cmd.params if isinstance(p.envvar, str)}
    commands = {"manager": "manager", "worker": "worker", "serve": "frontdoor"}
    for name, svc in services().items():
        env = svc.get("environment") or {}
        for var in env:
            if var in envvars:
                continue
            m = re.fullmatch(r"KVPOOL_(MANAGER|WORKER|FRONTDOOR)_(\w+)", var)
            assert m, f"{name}: {var} is neither a command option's envvar nor a KVPOOL_<SERVICE>_<FIELD>"
            fields = {f.lower() for f in service_class(m.group(1).lower()).__dataclass_fields__}
            assert m.group(2).lower() in fields, f"{name}: {var} names no {m.group(1).lower()} config field"
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd[0] in commands:
            flags = {o for p in cli.commands[cmd[0]].params for o in p.opts}
            assert all(a in flags for a in cmd[1:] if a.startswith("-")), f"{name}: {cmd}"


def test_dockerfiles_copy_every_package_directory():
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    tops = {d.split("/")[0] for d in dirs}
    for name in ("Dockerfile.manager", "Dockerfile.worker"):
        copied = {ln.split()[1] for ln in (ROOT / "docker" / name).read_text().splitlines() if ln.startswith("COPY ")}
        assert tops <= copied, f"{name} lacks COPY of {sorted(tops - copied)}: `pip install .` would fail"


@pytest.mark.skipif(shutil.which("sh") is None, reason="no sh")
def test_keys_step_gives_the_front_door_keys_every_server_allows(tmp_path):
    """The keys step's script, run for real (kvpool keygen included) into a directory here; then
    the front door's settings as compose gives them load those keys."""
    script = services()["keys"]["command"][0].replace("$$", "$").replace("/keys", str(tmp_path))
    script = "\n".join(ln for ln in script.splitlines() if not ln.strip().startswith("chown"))
    kvpool = shutil.which("kvpool") or str(Path(sys.executable).with_name("kvpool"))
    for _ in range(2):  # idempotent: a second run (an existing volume) keeps the keys
        out = subprocess.run(["sh", "-ec", script.replace("kvpool keygen", f"{kvpool} keygen")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        if _ == 0:
            first = (tmp_path / "frontdoor.key_secret").read_bytes()
    assert (tmp_path / "frontdoor.key_secret").read_bytes() == first
    assert (tmp_path / "allowed" / "frontdoor.key").exists() and (tmp_path / "worker-allowed" / "frontdoor.key").exists()
    assert not (tmp_path / "worker-allowed" / "worker.key").exists()
    s = services()
    fd_env = {**s["frontdoor"]["environment"]}
    worker_env = s["worker-0"]["environment"]
    assert worker_env["KVPOOL_WORKER_CURVE_ALLOWED_KEYS_DIR"] == "/keys/worker-allowed"

    def here(path: str) -> str:
        return path.replace("/keys", str(tmp_path))

    cfg = ServeConfig(managers=[fd_env["KVPOOL_MANAGER"]], curve_server_key=here(fd_env["KVPOOL_CURVE_SERVER_KEY"]),
                      curve_key_file=here(fd_env["KVPOOL_CURVE_KEY_FILE"]),
                      worker_curve_key=here(fd_env["KVPOOL_WORKER_CURVE_KEY"]))
    fd_cfg = cfg.frontdoor_config()  # tcp://manager:5555 is accepted because CURVE is on
    packaged, _ = load(ServeConfig, "frontdoor", ROOT / "docker" / "config" / "frontdoor.toml", env={})
    keys = ServeConfig(host="0.0.0.0", api_key_file=here(packaged.api_key_file)).api_keys()
    assert len(keys) == 1 and len(keys[0]) >= 32  # the keys step wrote the front door's API key
    assert fd_cfg.worker_keys.server_public in (tmp_path / "worker.key").read_bytes()
    assert fd_cfg.manager_keys.public in (tmp_path / "allowed" / "frontdoor.key").read_bytes()
