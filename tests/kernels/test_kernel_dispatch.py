"""Backend selection: which implementation each public op runs, and the failure messages."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from kernel_factories import assert_close, make_batch

import kvpool.kernels as kernels
from kvpool.kernels import dispatch, reference


def _spy(monkeypatch, owner, name: str) -> list:
    calls: list = []
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def test_set_backend_rejects_unknown_names(backend):
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'; choose one of auto"):
        backend("cuda")
    backend("torch")
    assert kernels.get_backend() == "torch"


def test_auto_runs_the_reference_for_cpu_tensors(backend, monkeypatch):
    # where the C++ CPU op is not built (test_kernel_cpu_op.py covers where it is)
    monkeypatch.setattr(dispatch.cpu_build, "load", lambda: False)
    backend("auto")
    ops = dispatch._triton_ops()
    triton_calls = _spy(monkeypatch, ops, "paged_attention")
    ref_calls = _spy(monkeypatch, reference, "paged_attention_ref")
    batch = make_batch([2, 1], [9, 30], device="cpu")
    kernels.paged_attention(*batch.args())
    assert len(ref_calls) == 1 and not triton_calls


def test_triton_backend_routes_prefill_and_long_decode(backend, monkeypatch):
    backend("triton")
    ops = dispatch._triton_ops()
    one_pass, split = _spy(monkeypatch, ops, "paged_attention"), _spy(monkeypatch, ops, "decode_split_kv")
    ref_calls = _spy(monkeypatch, reference, "paged_attention_ref")
    prefill = make_batch([3, 1], [9, 30])
    assert_close(kernels.paged_attention(*prefill.args()), reference.paged_attention_ref(*prefill.args()))
    assert (len(one_pass), len(split)) == (1, 0)
    # A decode batch whose longest context is 1100 positions: two splits of at least 512.
    decode = make_batch([1, 1], [40, 1100], block_size=16, extra_cols=3)
    assert decode.meta.max_seq_len == 1100
    got = kernels.paged_attention(*decode.args(softcap=3.0))
    assert_close(got, reference.paged_attention_ref(*decode.args(softcap=3.0)))
    assert (len(one_pass), len(split)) == (1, 1) and split[0][3] == 2
    assert len(ref_calls) == 2  # only the two comparisons above


def test_triton_backend_runs_cache_kernels(backend, monkeypatch):
    backend("triton")
    ops = dispatch._triton_ops()
    write, copy = _spy(monkeypatch, ops, "reshape_and_cache"), _spy(monkeypatch, ops, "copy_blocks")
    batch = make_batch([1], [3])
    cache = batch.kv_cache
    key = torch.ones(1, 1, 64, device=cache.device)
    kernels.reshape_and_cache(key, key, cache, torch.tensor([16], device=cache.device))
    kernels.copy_blocks([cache], torch.tensor([[1, 2]], device=cache.device))
    assert len(write) == 1 and len(copy) == 1
    assert torch.equal(cache[:, 1, 0], key[0].expand(2, 1, 64)) and torch.equal(cache[:, 2], cache[:, 1])


def test_triton_on_cpu_without_interpreter_says_what_to_set(backend, monkeypatch):
    backend("triton")
    monkeypatch.setattr(dispatch._triton_ops(), "interpret", False)
    batch = make_batch([1], [3], device="cpu")
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        kernels.paged_attention(*batch.args())


def test_missing_triton_fails_loudly_only_when_requested(backend, monkeypatch, caplog):
    # Importing triton (or a kernel module, which imports it) now raises ImportError.
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for op in ("copy_blocks_triton", "decode_split_kv", "paged_attention_triton", "reshape_and_cache_triton"):
        monkeypatch.delitem(sys.modules, f"kvpool.kernels.{op}", raising=False)
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        assert dispatch._triton_ops.__wrapped__() is None
    assert "Triton kernels unavailable" in caplog.text
    monkeypatch.setattr(dispatch, "_triton_ops", lambda: None)
    batch = make_batch([1], [3], device="cpu")
    backend("auto")
    assert_close(kernels.paged_attention(*batch.args()), reference.paged_attention_ref(*batch.args()))
    backend("triton")
    with pytest.raises(RuntimeError, match="triton cannot be imported"):
        kernels.paged_attention(*batch.args())


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )


def test_env_var_sets_the_initial_backend():
    res = _run_python("import kvpool.kernels as k; print(k.get_backend())", KVPOOL_KERNEL_BACKEND="torch")
    assert res.returncode == 0 and res.stdout.strip() == "torch", res.stderr
    res = _run_python("import kvpool.kernels", KVPOOL_KERNEL_BACKEND="fast")
    assert res.returncode != 0 and "unknown kernel backend 'fast'" in res.stderr


def test_package_imports_and_computes_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kvpool.kernels as k\n"
        "cache = torch.zeros(2, 2, 4, 1, 8)\n"
        "k.reshape_and_cache(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([5]))\n"
        "meta = k.AttentionMetadata.from_lengths([1], [2], [[1]], 0.0)\n"
        "o = k.paged_attention(torch.ones(1, 1, 8), cache, meta)\n"
        "print(o.sum().item())\n"
    )
    res = _run_python(code, KVPOOL_KERNEL_BACKEND="auto")
    # Scale 0 makes the logits equal: positions 0 (V = 0) and 1 (V = 1) average to 0.5 x 8 dims.
    assert res.returncode == 0 and res.stdout.strip() == "4.0", res.stderr


def test_public_names_stay_functions_after_kernel_modules_load():
    # Kernel modules are named *_triton, so loading them cannot rebind the package's public
    # functions; the package is a plain module (no __class__ swap keeps them bound).
    import types

    import kvpool.kernels.copy_blocks_triton  # noqa: F401
    import kvpool.kernels.paged_attention_triton  # noqa: F401
    import kvpool.kernels.reshape_and_cache_triton  # noqa: F401

    assert type(kernels) is types.ModuleType
    for name in ("paged_attention", "reshape_and_cache", "copy_blocks"):
        assert getattr(kernels, name) is getattr(dispatch, name)
    assert set(kernels.__all__) <= set(dir(kernels))
