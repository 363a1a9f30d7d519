"""systemd units and Docker files: checked with the tools that exist here."""

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "docker" / "systemd"


def read_unit(name):
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read(UNITS / name)
    return cp


def test_manager_unit_is_notify_with_watchdog_and_hardening():
    u = read_unit("kvpool-manager.service")["Service"]
    assert u["Type"] == "notify" and u["NotifyAccess"] == "main"
    assert int(u["WatchdogSec"]) > 0 and u["Restart"] == "on-failure"
    assert u["RuntimeDirectory"] == "kvpool"
    assert u["ExecStart"].split()[1:3] == ["manager", "--config"]
    for key in ("NoNewPrivileges", "ProtectSystem", "PrivateTmp", "RestrictAddressFamilies"):
        assert key in u


def test_worker_unit_is_templated_per_gpu_and_after_manager():
    u = read_unit("kvpool-worker@.service")
    assert "kvpool-manager.service" in u["Unit"]["After"]
    assert u["Service"]["ExecStart"].split()[1] == "worker"
    env = [ln for ln in (UNITS / "kvpool-worker@.service").read_text().splitlines() if ln.startswith("Environment=")]
    assert "Environment=CUDA_VISIBLE_DEVICES=%i" in env


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_pass_systemd_analyze_verify(tmp_path):
    kvpool = Path(sys.executable).with_name("kvpool")
    assert kvpool.exists(), "the kvpool console script must be installed beside python"
    names = []
    for unit in UNITS.glob("*.service"):
        text = unit.read_text().replace("/usr/local/bin/kvpool", str(kvpool))
        name = unit.name.replace("@.service", "@0.service")  # verify an instance of the template
        (tmp_path / name).write_text(text)
        names.append(str(tmp_path / name))
    res = subprocess.run(["systemd-analyze", "verify", *names], capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    problems = [line for line in out.splitlines() if str(tmp_path) in line or "kvpool" in line]
    assert res.returncode == 0 and not problems, out


def test_dockerfiles_copy_what_exists_and_run_real_commands():
    for name in ("Dockerfile.manager", "Dockerfile.worker"):
        text = (ROOT / "docker" / name).read_text()
        for line in text.splitlines():
            parts = line.split()
            if parts[:1] == ["COPY"] and "--from" not in line:
                for src in parts[1:-1]:
                    assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
        assert 'ENTRYPOINT ["kvpool"]' in text


# -- the commands the units, images and compose file run must exist -------------------------


def _kvpool_commands() -> list[list[str]]:
    """Every `kvpool ...` argv in the units, the Dockerfiles and the compose file."""
    import json
    import re
    import shlex

    argvs = []
    for unit in UNITS.glob("*.service"):
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                argvs.append(shlex.split(line.split("=", 1)[1])[1:])
    for name in ("Dockerfile.manager", "Dockerfile.worker"):
        text = (ROOT / "docker" / name).read_text().replace("\\\n", " ")
        argvs += [json.loads(m)[1:] if m.startswith('["kvpool"') else json.loads(m)
                  for m in re.findall(r"\bCMD (\[.*\])$", text, re.M)]
        argvs += [shlex.split(m)[1:] for m in re.findall(r"CMD (kvpool .*)$", text, re.M)]
    compose = (ROOT / "docker" / "compose.yaml").read_text()
    for m in re.findall(r"(?:command|test): (\[.*?\])", compose, re.S):
        argv = json.loads(m)
        if argv[0] == "CMD-SHELL":
            argv = shlex.split(argv[1])
        elif argv[0] == "CMD":
            argv = argv[1:]
        if argv[0] == "kvpool":
            argvs.append(argv[1:])
        elif argv[0] in ("manager", "worker"):
            argvs.append(argv)
    return argvs


def test_every_kvpool_command_line_uses_existing_commands_and_flags():
    from kvpool.cli.main import cli

    argvs = _kvpool_commands()
    assert {a[0] for a in argvs} >= {"manager", "worker", "status"}
    for argv in argvs:
        cmd = cli.commands[argv[0]]
        flags = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for arg in argv[1:]:
            if arg.startswith("-"):
                assert arg.split("=")[0] in flags, f"`kvpool {' '.join(argv)}`: no option {arg}"


def test_compose_has_redis_manager_gpu_workers_and_status_healthchecks():
    text = (ROOT / "docker" / "compose.yaml").read_text()
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (test_compose_text_checks still runs)")
    doc = yaml.safe_load(text)
    services = doc["services"]
    assert {"redis", "manager", "worker-0", "worker-1"} <= set(services)
    assert "--redis-url" in services["manager"]["command"]
    for name in ("worker-0", "worker-1"):
        w = services[name]
        assert w["depends_on"]["manager"]["condition"] == "service_healthy"
        assert w["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert "kvpool status" in w["healthcheck"]["test"][1]
    assert services["manager"]["healthcheck"]["test"][1:3] == ["kvpool", "status"]


def test_compose_text_checks():
    text = (ROOT / "docker" / "compose.yaml").read_text()
    assert text.count("kvpool status") >= 1 and text.count('"kvpool", "status"') == 1
    assert text.count("capabilities: [gpu]") == 2 and "redis:7" in text
    assert "\t" not in text, "YAML forbids tabs"


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker not installed")
def test_compose_file_passes_docker_compose_config():
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode:
        pytest.skip("the docker compose plugin is not installed")
    res = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker" / "compose.yaml"), "config", "-q"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_packaged_config_files_load_into_the_real_config_classes():
    from kvpool.manager.config import ManagerConfig
    from kvpool.shared.config import load
    from kvpool.worker.config import WorkerConfig

    cfg, src = load(ManagerConfig, "manager", ROOT / "docker" / "config" / "manager.toml", env={})
    assert cfg.metrics_port == 9400 and cfg.events_endpoint and src["endpoint"].startswith("file ")
    wcfg, _ = load(WorkerConfig, "worker", ROOT / "docker" / "config" / "worker.toml", env={"KVPOOL_WORKER_POOL": "gpu3"})
    assert wcfg.pool == "gpu3" and wcfg.device == "cuda:0"


def test_a_manager_restart_does_not_restart_the_workers():
    """Workers carry on through a manager restart (they re-register): no PartOf/BindsTo on it."""
    unit = read_unit("kvpool-worker@.service")["Unit"]
    for key in ("PartOf", "BindsTo", "Requires"):
        assert "kvpool-manager.service" not in unit.get(key, ""), key


def test_the_documented_high_water_path_is_writable_under_the_managers_hardening():
    import re

    u = read_unit("kvpool-manager.service")["Service"]
    assert u["ProtectSystem"] == "strict"
    writable = [f"/run/{u['RuntimeDirectory']}", f"/var/lib/{u['StateDirectory']}",
                *u.get("ReadWritePaths", "").replace("-", "").split()]
    doc = (ROOT / "docs" / "operating.md").read_text()
    paths = set(re.findall(r"`(/var/lib/kvpool/[^`]*|/run/kvpool/[^`]*)`", doc))
    assert any(p.startswith("/var/lib/kvpool/") for p in paths)
    for p in paths:
        assert any(p.startswith(w + "/") for w in writable), f"{p} is read-only under ProtectSystem=strict"
