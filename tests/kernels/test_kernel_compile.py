"""Every kernel compiles to an sm_90 cubin without spills, checked even on machines without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.kernels.attention_common import Tiles, choose_tiles

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")


def test_kernels_compile_for_a_gpu_target_without_spills():
    pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=400, env=env
    )
    print(res.stdout)  # registers, stack and shared memory per variant (pytest -s shows them)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SPILL" not in res.stdout and res.stdout.count("ok ") == 23, res.stdout
    assert res.stdout.count("stack     0") >= 21, res.stdout  # all but the timed 16-bit prefill tiles


@pytest.mark.parametrize(
    "head_size,avg_rows,qpk,elem_bytes,expected",
    [
        (128, 64, 1, 2, Tiles(64, 32, 4, 2)),  # prefill, 16-bit, head <= 128: 4 warps timed faster
        (128, 64, 1, 4, Tiles(64, 32, 8)),  # the same in fp32
        (80, 1, 4, 2, Tiles(16, 32, 4)),  # decode
        (256, 64, 1, 2, Tiles(32, 16, 8)),  # 64 rows would spill at head 256
        (512, 64, 4, 4, Tiles(16, 16, 8)),
        (256, 1, 4, 2, Tiles(16, 16, 8)),  # 16 rows at head 256 spill a little with 4 warps
        (128, 1, 4, 4, Tiles(16, 16, 4)),  # a 16-row fp32 program spills with 32-wide tiles
        (512, 1, 32, 2, Tiles(32, 16, 8)),  # a program holds a whole GQA group
    ],
)
def test_tiles_follow_the_head_size(head_size, avg_rows, qpk, elem_bytes, expected):
    assert choose_tiles(head_size, avg_rows, qpk, elem_bytes) == expected


def test_tile_n_override_must_be_a_power_of_two():
    assert choose_tiles(128, 1, 1, 2, tile_n=64).tile_n == 64
    with pytest.raises(ValueError, match="tile_n 24 must be a power of two >= 16"):
        choose_tiles(128, 1, 1, 2, tile_n=24)
