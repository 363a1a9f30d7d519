"""scripts/bench_recovery.py on a small state: it recovers exactly the state it built (the script
exits otherwise) and reports each figure, the stall beside the recovery included (no timed
assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_recovery.py"
pytestmark = pytest.mark.redis


def test_a_small_state_recovers_exactly_and_every_figure_is_reported():
    out = subprocess.run([sys.executable, str(SCRIPT), "--blocks", "20000", "--tail-steps", "40", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["blocks"] == 20000 and got["journal_batches"] > 0 and got["requests"] > 0
    for key in ("snapshot_pause_new_s", "snapshot_pause_old_s", "recover_s", "recover_old_s", "longest_stall_s"):
        assert got[key] >= 0, key
