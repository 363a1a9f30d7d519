"""The C++ CPU attention op (kernels/paged_attention_cpu.py) against float64 truth and the torch
reference, on odd shapes; its build, its cache and the fallback where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_factories import assert_close, make_batch, naive_attention

import kvpool.kernels as kernels
from kvpool.kernels import cpu_build, dispatch, paged_attention_cpu, reference
from kvpool.kernels.paged_attention_cpu import ROWS_MAX_QUERY

needs_op = pytest.mark.skipif(not cpu_build.load(), reason="the C++ CPU op did not build here (no compiler?)")

# Decode rows at contexts 1, 17 and 129, a short chunk (rows), a long one (gather + SDPA), and a
# query of 0 tokens.
MIXED = dict(q_lens=[1, 1, 1, 5, ROWS_MAX_QUERY + 3, 0], seq_lens=[1, 17, 129, 40, 133, 9])


@needs_op
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,softcap",
    [
        (2, 2, 64, 16, None, None),
        (4, 1, 80, 32, None, None),  # GQA 4:1
        (6, 2, 96, 16, 7, None),
        (4, 2, 72, 16, None, 3.0),  # 72: the lane loop's remainder
        (8, 2, 128, 32, 50, 10.0),
        (3, 3, 8, 1, None, None),  # block size 1, a head shorter than one lane group
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_op_matches_float64_truth_and_the_reference(num_heads, num_kv_heads, head_size, block_size,
                                                       window, softcap, dtype):
    batch = make_batch(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, extra_cols=2, dtype=dtype, device="cpu")
    args = batch.args(sliding_window=window, softcap=softcap)
    got = paged_attention_cpu.paged_attention_cpu(*args)
    assert_close(got, naive_attention(batch, window, softcap))
    assert_close(got, reference.paged_attention_ref(*args))


@needs_op
def test_rows_read_blocks_through_the_table_in_any_order():
    # The same contexts under two different shuffles of block ids give the same output: the op
    # follows each table, and a wrong block (the cache is random everywhere) would show.
    a = make_batch([1, 1, 3], [70, 33, 50], num_heads=4, num_kv_heads=2, seed=1, device="cpu")
    perm = torch.randperm(a.kv_cache.shape[1] - 1, generator=torch.Generator().manual_seed(5)) + 1
    cache = a.kv_cache.clone()
    cache[:, perm] = a.kv_cache[:, 1:]
    table = a.meta.block_tables.clone()
    used = table > 0
    table[used] = perm[table[used].long() - 1].int()
    b = kernels.AttentionMetadata.from_lengths([1, 1, 3], [70, 33, 50], table.tolist(), a.meta.scale)
    want = paged_attention_cpu.paged_attention_cpu(*a.args())
    got = paged_attention_cpu.paged_attention_cpu(a.query, cache, b)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@needs_op
def test_the_op_refuses_blocks_outside_the_cache():
    batch = make_batch([1], [20], device="cpu")
    rows = [torch.tensor([0]), torch.tensor([0]), torch.tensor([19])]
    bad = batch.meta.block_tables.clone()
    bad[0, 1] = batch.kv_cache.shape[1]  # one past the last block
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.kvpool_cpu.paged_attention_rows(out, batch.query, batch.kv_cache, bad, *rows,
                                                  batch.meta.scale, 0.0, 0)
    with pytest.raises(RuntimeError, match="outside the block table"):
        torch.ops.kvpool_cpu.paged_attention_rows(out, batch.query, batch.kv_cache, batch.meta.block_tables,
                                                  rows[0], rows[1], torch.tensor([10_000]),
                                                  batch.meta.scale, 0.0, 0)


@needs_op
def test_auto_runs_the_cpu_op_where_it_is_built(backend, monkeypatch):
    backend("auto")
    calls: list = []
    real = dispatch.paged_attention_cpu
    monkeypatch.setattr(dispatch, "paged_attention_cpu", lambda *a, **k: calls.append(a) or real(*a, **k))
    batch = make_batch([1, 4], [30, 9], device="cpu")
    assert_close(kernels.paged_attention(*batch.args()), reference.paged_attention_ref(*batch.args()))
    assert len(calls) == 1


def test_without_a_compiler_nothing_builds(tmp_path):
    assert cpu_build.build(tmp_path, cxx=str(tmp_path / "no-such-c++")) is None
    assert list(tmp_path.glob("*.so")) == []


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env})


_COMPUTE = (
    "import torch, kvpool.kernels as k\n"
    "from kvpool.kernels import cpu_build, reference\n"
    "meta = k.AttentionMetadata.from_lengths([1, 3], [40, 9], [[2, 1], [3]], 0.125)\n"
    "q, cache = torch.randn(4, 4, 64), torch.randn(2, 4, 32, 2, 64)\n"
    "got = k.paged_attention(q, cache, meta)\n"
    "torch.testing.assert_close(got, reference.paged_attention_ref(q, cache, meta), atol=2e-5, rtol=2e-5)\n"
    "print(cpu_build.load())\n"
)


def test_no_compiler_keeps_the_torch_path_and_the_cpu_backend_says_why(tmp_path):
    res = _run(_COMPUTE, KVPOOL_KERNEL_CACHE=str(tmp_path), KVPOOL_CXX=str(tmp_path / "no-such-c++"))
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
    assert "no C++ compiler" in res.stderr
    res = _run(_COMPUTE, KVPOOL_KERNEL_CACHE=str(tmp_path), KVPOOL_CXX=str(tmp_path / "no-such-c++"),
               KVPOOL_KERNEL_BACKEND="cpu")
    assert res.returncode != 0 and "kernel backend 'cpu' was requested" in res.stderr


def test_kvpool_cpu_kernels_0_keeps_the_torch_path():
    res = _run(_COMPUTE, KVPOOL_CPU_KERNELS="0")
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


@pytest.mark.slow
@pytest.mark.skipif(cpu_build.compiler() is None, reason="no C++ compiler")
@pytest.mark.timeout(1200)  # two C++ builds beside each other: minutes on a loaded 2-core machine
def test_a_fresh_cache_builds_once_and_the_library_computes(tmp_path):
    """The build from nothing (what install.sh runs), then a second process that finds it."""
    res = _run("import sys; from kvpool.kernels import cpu_build; sys.exit(cpu_build.main())",
               KVPOOL_KERNEL_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    built = list(tmp_path.glob("kvpool_cpu_*.so"))
    assert len(built) == 1 and built[0] == cpu_build.library_path(tmp_path)
    stamp = built[0].stat().st_mtime_ns
    res = _run(_COMPUTE, KVPOOL_KERNEL_CACHE=str(tmp_path), KVPOOL_KERNEL_BACKEND="cpu")
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
    assert built[0].stat().st_mtime_ns == stamp and "building" not in res.stderr


def test_the_library_name_changes_with_what_it_depends_on(tmp_path, monkeypatch):
    first = cpu_build.library_path(tmp_path)
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "another cpu")
    assert cpu_build.library_path(tmp_path) != first
    second = cpu_build.library_path(tmp_path)
    monkeypatch.setattr(cpu_build, "FLAGS", ("-O2",))
    assert cpu_build.library_path(tmp_path) not in (first, second)
    assert first.parent == Path(tmp_path)
