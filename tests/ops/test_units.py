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
