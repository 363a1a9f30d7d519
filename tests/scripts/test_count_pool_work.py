"""scripts/count_pool_work.py: the counts are exact (the same replay counts the same bytecodes)
and the script prints both builds with --against."""

import importlib
import subprocess
import sys
from pathlib import Path

from kvpool.bench.trace import TraceConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_same_replay_counts_the_same_bytecodes_in_the_core_only():
    sys.path.insert(0, str(ROOT / "scripts"))
    count = importlib.import_module("count_pool_work").count
    cfg = TraceConfig(num_requests=120, num_blocks=256)  # 256 blocks: the last requests evict
    first, blocks = count("kvpool", cfg, warmup=60)
    again, blocks_again = count("kvpool", cfg, warmup=60)
    assert first == again and blocks == blocks_again > 0
    files = {file for _, file, _ in first}
    assert files <= {"hashing.py", "pool.py", "block_pool.py", "free_queue.py", "host_tier.py"}
    assert first[("hash", "hashing.py", "hash_blocks")] > 0
    assert first[("pool", "block_pool.py", "free_blocks")] > 0 and first[("pool", "pool.py", "allocate")] > 0


def test_against_head_prints_both_columns():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_pool_work.py"), "--requests", "50",
                          "--warmup", "50", "--against", "HEAD"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert "columns: this build, HEAD" in res.stdout and "block_pool.py:free_blocks" in res.stdout
    assert "difference" in res.stdout and "WARNING" not in res.stdout
