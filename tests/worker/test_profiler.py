"""Memory profiling arithmetic (injected profiles) and the engine's refusal of tiny pools."""

from __future__ import annotations

import pytest
import torch
from helpers.worker import BLOCK_BYTES, TINY

from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import WorkerConfig
from kvpool.worker.model import build_model
from kvpool.worker.profiler import (
    KVMemoryError,
    MemoryProfile,
    check_fits,
    kv_cache_budget,
    num_blocks_for,
    page_bytes,
    profile_cpu,
)
from kvpool.worker.startup import build_engine

GiB = 1 << 30


def test_budget_arithmetic():
    p = MemoryProfile(total=80 * GiB, weights=16 * GiB, activation_peak=4 * GiB, non_torch=GiB)
    assert kv_cache_budget(p, 0.9) == int(80 * GiB * 0.9) - 21 * GiB


def test_llama_3_8b_on_an_80_gib_gpu():
    # bf16 Llama-3-8B: 32 layers x 8 kv heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token
    page = page_bytes(16, 8, 128, torch.bfloat16)
    assert page * 32 == 16 * 128 * 1024
    available = kv_cache_budget(MemoryProfile(80 * GiB, 15 * GiB, 2 * GiB, GiB // 2), 0.9)
    assert num_blocks_for(available, page, 32) == available // (2 * 1024 * 1024)


def test_no_room_says_what_to_change():
    p = MemoryProfile(total=16 * GiB, weights=15 * GiB, activation_peak=GiB)
    with pytest.raises(KVMemoryError, match="raise memory_utilization, lower max_num_batched_tokens"):
        kv_cache_budget(p, 0.9)


def test_other_processes_counted():
    p = MemoryProfile(total=80 * GiB, weights=GiB, activation_peak=GiB, used_by_others=20 * GiB)
    with pytest.raises(KVMemoryError, match=r"lower memory_utilization to <= 0\.75"):
        kv_cache_budget(p, 0.9)
    assert kv_cache_budget(p, 0.75) == 60 * GiB - 2 * GiB


def test_pool_must_hold_one_max_model_len_request():
    check_fits(65, 16, 1024)  # 64 usable blocks of 16 = 1024 tokens
    with pytest.raises(KVMemoryError, match="max_model_len=1025 request needs 65"):
        check_fits(65, 16, 1025)


def test_engine_refuses_a_pool_too_small():
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=10 * BLOCK_BYTES,
                       max_model_len=256)
    with pytest.raises(KVMemoryError, match="lower max_model_len"):
        build_engine(cfg, LocalBlockManager())


def test_kv_cache_memory_override_sizes_the_pool():
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=100 * BLOCK_BYTES + 5,
                       max_model_len=256)
    engine = build_engine(cfg, LocalBlockManager())
    assert engine.num_blocks == 100
    assert [tuple(c.shape) for c in engine.runner.kv_caches] == [(2, 100, 16, 2, 16)] * TINY.num_layers


def test_cpu_profile_counts_weights_and_budget():
    model = build_model(TINY, torch.float32, "cpu")
    weights = sum(p.numel() * 4 for p in model.parameters())
    calls = []
    p = profile_cpu(model, lambda: calls.append(1), budget=GiB, activation_estimate=12345)
    assert calls == [1] and p.total == GiB and p.weights == weights and p.activation_peak >= 12345


def test_cpu_profile_end_to_end():
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", cpu_memory_budget=64 << 20,
                       max_model_len=256, max_num_batched_tokens=256)
    engine = build_engine(cfg, LocalBlockManager())
    assert 0 < engine.num_blocks * BLOCK_BYTES <= int(0.9 * (64 << 20))


def test_profile_cuda_measures_with_the_allocator(monkeypatch):
    """The CUDA method over faked allocator and driver readings (no GPU needed)."""
    state = {"alloc": 1 * GiB, "reserved": 1 * GiB, "peak": 0, "free": 70 * GiB}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (state["free"], 80 * GiB))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: state["alloc"])
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["alloc"]))

    def load():  # 16 GiB of weights
        state.update(alloc=17 * GiB, reserved=17 * GiB, free=54 * GiB)

    def forward():  # a 3 GiB activation peak, and the CUDA context grows by 0.5 GiB outside torch
        state.update(peak=20 * GiB, reserved=20 * GiB, free=50 * GiB + GiB // 2)

    from kvpool.worker.profiler import profile_cuda

    p = profile_cuda(load, forward, torch.device("cuda", 0))
    # before: 10 GiB used, 1 GiB of it by torch -> 9 GiB used by others (other processes, context)
    assert (p.total, p.weights, p.activation_peak) == (80 * GiB, 16 * GiB, 3 * GiB)
    assert p.non_torch == GiB // 2 and p.used_by_others == 9 * GiB
    assert kv_cache_budget(p, 0.85) == int(80 * GiB * 0.85) - 16 * GiB - 3 * GiB - GiB // 2


def test_realistic_presets_have_their_published_sizes():
    from kvpool.worker.config import PRESETS
    from kvpool.worker.model import LlamaForCausalLM

    def params(name):
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(PRESETS[name]).parameters())

    assert round(params("llama-3-8b") / 1e9, 2) == 8.03
    assert round(params("qwen2-0.5b") / 1e9, 2) == 0.49
    assert round(params("llama-3.2-1b") / 1e9, 2) == 1.24
