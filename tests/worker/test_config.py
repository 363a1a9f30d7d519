from __future__ import annotations

import pytest

from kvpool.worker.config import PRESETS, ModelConfig, WorkerConfig, parse_bytes


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("1.5G") == 3 << 29
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="512MiB"):
        parse_bytes("lots")


@pytest.mark.parametrize("kw, msg", [
    (dict(block_size=12), "power of two"),
    (dict(memory_utilization=1.5), "memory_utilization"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=1024), "raise max_num_batched_tokens"),
    (dict(dtype="int8"), "dtype"),
    (dict(kv_cache_memory=0), "kv_cache_memory"),
    (dict(node_tier_read_timeout=0), "node_tier_read_timeout"),
    (dict(node_tier_read_timeout=float("nan")), "node_tier_read_timeout"),
])
def test_worker_config_validates(kw, msg):
    with pytest.raises(ValueError, match=msg):
        WorkerConfig(**kw)


def test_model_config_validates():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=6, num_kv_heads=4)
    assert PRESETS["llama-3-8b"].head_size == 128 and PRESETS["qwen2-0.5b"].head_size == 64


def test_overlap_is_on_by_default_and_no_overlap_turns_it_off():
    from kvpool.cli.serve import _worker_config, worker

    assert WorkerConfig().overlap is True
    ctx = worker.make_context("worker", ["--no-overlap"])
    cfg, source = _worker_config(ctx, None, ctx.params["no_prefix_caching"], ctx.params["no_overlap"])
    assert cfg.overlap is False and source["overlap"] == "flag"
    ctx = worker.make_context("worker", [])
    assert _worker_config(ctx, None, False, ctx.params["no_overlap"])[0].overlap is True


def test_default_threads_leaves_a_core_for_the_rest():
    from kvpool.worker.config import default_threads

    assert default_threads(1) == 1  # never below one
    assert default_threads(2) == 1  # the 2-core case of issue 25: one compute thread, one spare core
    assert default_threads(16) == 15
    assert default_threads(16, tp_size=4) == 3  # ranks on one host share the cores
    assert default_threads(2, tp_size=2) == 1
    with pytest.raises(ValueError, match="cpus >= 1"):
        default_threads(0)


def test_resolve_threads_takes_an_explicit_count_as_is():
    import os

    from kvpool.worker.config import resolve_threads

    assert resolve_threads(3, cpus=2) == 3  # an operator's choice wins, even oversubscribed
    assert resolve_threads(0, cpus=8) == 7
    assert resolve_threads(0) == max(1, len(os.sched_getaffinity(0)) - 1)
    with pytest.raises(ValueError, match="threads must be >= 0"):
        resolve_threads(-1)
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        WorkerConfig(threads=-2)


def test_max_model_len_defaults_to_the_models_own_and_a_longer_one_is_refused_before_loading():
    from kvpool.worker.checkpoint import load_config
    from kvpool.worker.config import with_model_len

    tiny = load_config("tiny")
    assert with_model_len(WorkerConfig(model="tiny"), tiny).max_model_len == tiny.max_position  # as vLLM
    assert with_model_len(WorkerConfig(model="tiny", max_model_len=300), tiny).max_model_len == 300
    with pytest.raises(ValueError, match="max_position_embeddings: 2048"):
        with_model_len(WorkerConfig(model="tiny", max_model_len=4096), tiny)
    with pytest.raises(ValueError, match="raise max_num_batched_tokens"):  # checked again once settled
        with_model_len(WorkerConfig(model="tiny", enable_chunked_prefill=False, max_num_batched_tokens=64), tiny)
