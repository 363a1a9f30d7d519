"""scripts/bench_pool.py runs end to end, alone and against a git revision in the same run."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pool.py"), "--requests", "300",
                           "--rounds", "2", *args], capture_output=True, text=True, timeout=300, check=False)


def test_against_head_runs_both_builds_on_the_same_trace():
    res = run("--against", "HEAD", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    this, base = out["with_hashing"], out["against"]["with_hashing"]
    assert out["against"]["rev"] == "HEAD" and len(out["against"]["rounds"]) == 2
    # HEAD's core replays the same trace to the same hits and blocks (the figures are CPU times)
    for key in ("prefix_hit_rate", "blocks_per_request", "evictions"):
        assert base[key] == this[key], key
    assert base["prefix_hit_rate"] > 0 and base["cpu_us_per_request"] > 0


def test_text_report_prints_the_ratios_and_an_unknown_revision_is_a_clear_error():
    res = run("--against", "HEAD")
    assert res.returncode == 0, res.stderr
    assert "against HEAD in the same run" in res.stdout and "x\n" in res.stdout
    bad = run("--against", "no-such-revision-xyz")
    assert bad.returncode != 0 and "git archive no-such-revision-xyz failed" in bad.stderr
