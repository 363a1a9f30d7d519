"""scripts/bench_manager.py runs end to end and splits its clients' round trips with the daemon's rows."""

import json
import re
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
    text = subprocess.run([*cmd, "--explain"], capture_output=True, text=True, timeout=300, check=False)
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("tail: the slowest 1% of steps") == 2 and "per step message in the daemon" in text.stdout
    table = columns(text.stdout)
    assert table[0] == ["case", "ratio", "p50 us", "p99 us", "target"]
    assert [row[0].split()[0] for row in table[1:3]] == ["hashing", "prehashed"], table


def test_the_default_output_is_one_table_without_the_breakdown():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_manager.py"), "--requests", "200", "--clients", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert "tail:" not in res.stdout and "per step message in the daemon" not in res.stdout
    rows = columns(res.stdout)
    assert len(rows) == 3 and rows[0][:2] == ["case", "ratio"], res.stdout
    for case, ratio, p50, p99, target in rows[1:]:
        assert float(ratio.rstrip("x")) > 0 and 0 < float(p50.replace(",", "")) <= float(p99.replace(",", ""))
        assert target.startswith(">= 0.50x"), (case, target)


def columns(stdout: str) -> list[list[str]]:
    """The table: from its header to the first line that is not indented (cells 2+ spaces apart)."""
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.split()[:2] == ["case", "ratio"])
    rows = []
    for line in lines[first:]:
        if not line.startswith("  "):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows
