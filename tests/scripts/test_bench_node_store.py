"""scripts/bench_node_store.py runs in one short pass and prints every measurement against memcpy."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_node_store.py"


def test_a_short_run_reports_each_cost_against_memcpy(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--iters", "5", "--repeats", "1", "--json",
                           "--shm-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["block_bytes"] == 8192  # the tiny preset's block, fp32
    assert set(out["vs_memcpy"]) == {"memcpy", "torch copy_", "zlib.crc32", "xxh3_64", "xxh3_128", "host write",
                                     "host read", "disk write", "disk read"}
    assert out["vs_memcpy"]["memcpy"] == 1.0
