"""scripts/bench_manager.py runs end to end and splits its clients' round trips with the daemon's rows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from rtt_breakdown import PARTS  # noqa: E402


def test_small_run_joins_every_step_and_prints_the_tail_line():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_manager.py"), "--requests", "400", "--clients", "2"]
    res = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for run in ("hashing", "prehashed"):
        d = out[run]["daemon"]
        tail = d["tail"]
        assert tail["steps"] == d["steps"] > 0, run  # every step found its row in the daemon's ring
        assert 0 <= tail["queue_share"] < 1 and d["daemon_step_cpu_p50_us"] > 0
        assert sum(tail[f"{p}_mid_us"] for p in PARTS) == pytest.approx(tail["rtt_mid_us"])
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("tail: the slowest 1% of steps") == 2 and "per step message in the daemon" in text.stdout
