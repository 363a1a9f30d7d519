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
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "raise max_num_batched_tokens"),
    (dict(dtype="int8"), "dtype"),
    (dict(kv_cache_memory=0), "kv_cache_memory"),
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
