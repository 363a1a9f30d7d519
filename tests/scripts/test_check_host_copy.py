"""scripts/check_host_copy.py: the GPU check of the host tier's copies runs its round trip on
CPU with --cpu-smoke, and a round trip that loses a save fails it."""

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_host_copy.py"


def test_cpu_smoke_passes_the_round_trip():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "round trip: PASS" in done.stdout


def test_the_round_trip_fails_when_saves_never_land(monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    import check_host_copy

    from kvpool.worker.host_kv import HostCopier

    assert check_host_copy.round_trip("cpu", torch.float32, 2, 3)
    monkeypatch.setattr(HostCopier, "settle", lambda self: setattr(self, "in_flight", None))
    assert not check_host_copy.round_trip("cpu", torch.float32, 2, 3)
