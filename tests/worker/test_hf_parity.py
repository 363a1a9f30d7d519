"""Parity with transformers (the version the test extra resolves, 5.24.0 when written): tiny
random-weight checkpoints saved by transformers itself, loaded by the paged worker engine with the
in-process block manager, greedy output identical to ``model.generate(do_sample=False)`` token
for token, with prefix hits, chunked prefill and preemption. CPU, fp32.

Each case runs in both config layouts: transformers 5's ``rope_parameters`` (as saved) and the
4.x top-level ``rope_theta``/``rope_scaling`` (config.json rewritten)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers.hf import CASES, build, hf_greedy, prompts, save
from safetensors.torch import save_file

from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.checkpoint import load_config
from kvpool.worker.config import WorkerConfig
from kvpool.worker.reference import reference_generate
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.startup import build_engine

BLOCK, MAX_TOKENS = 4, 16


def paged_engine(path, max_blocks: int = 20):
    """Blocks of 4, steps of at most 16 tokens (chunked prefill), 20 blocks for four requests of up to
    67 tokens (preemption)."""
    cfg = load_config(str(path))
    page = 2 * BLOCK * cfg.num_kv_heads * cfg.head_size * 4 * cfg.num_layers
    wc = WorkerConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory=256 * page, block_size=BLOCK,
                      max_model_len=72, max_num_batched_tokens=16)
    return build_engine(wc, LocalBlockManager("parity", max_blocks=max_blocks))


@functools.cache
def reference(case: str, seed: int) -> tuple[object, list[list[int]], list[list[list[int]]]]:
    """(transformers model, prompts, its greedy outputs): one per case, for both layouts."""
    model = build(case, seed=seed)
    ps = prompts(seed + 1)
    return model, ps, [[hf_greedy(model, p, MAX_TOKENS)] for p in ps]


def check_parity(model, path, seed: int, want: list | None = None) -> dict:
    ps = prompts(seed)
    want = want or [[hf_greedy(model, p, MAX_TOKENS)] for p in ps]
    engine = paged_engine(path)
    got = engine.generate(ps, SamplingParams(max_tokens=MAX_TOKENS))
    again = engine.generate(ps[:1], SamplingParams(max_tokens=MAX_TOKENS))  # whole-prefix hits
    assert got == want
    assert again == want[:1]
    # the contiguous-KV reference (worker/reference.py), the paged path's twin, agrees too
    assert reference_generate(engine.model, ps[2], MAX_TOKENS, engine.model.config.eos_token_ids) == want[2][0]
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["cached_tokens"] > 0
    return stats


@pytest.mark.parametrize("layout", ["5", "4"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_transformers_generate(tmp_path, case, layout):
    model, _, want = reference(case, len(case))
    save(model, tmp_path, layout)
    written = json.loads((tmp_path / "config.json").read_text())
    assert ("rope_parameters" in written) == (layout == "5") and ("rope_theta" in written) == (layout == "4")
    cfg = load_config(str(tmp_path))
    if case == "llama-llama3":
        assert cfg.rope_theta == 50_000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    if case == "qwen2-tied-sliding":
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.tie_embeddings) == (6, (1,), True)
    check_parity(model, tmp_path, len(case) + 1, want)


def test_every_eos_id_of_generation_config_stops(tmp_path):
    """generation_config.json's eos list, as ``generate`` reads it, not config.json's single id."""
    model = build("llama", seed=5)
    ps = prompts(7)
    free_run = hf_greedy(model, ps[0], MAX_TOKENS)
    stop = next(t for i, t in enumerate(free_run) if i >= 4 and t not in free_run[:i])
    model.generation_config.eos_token_id = [2, stop]
    save(model, tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2, stop]
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 1
    want = [[hf_greedy(model, p, MAX_TOKENS)] for p in ps]
    assert want[0][0][-1] == stop and len(want[0][0]) < MAX_TOKENS
    assert load_config(str(tmp_path)).eos_token_ids == (2, stop)
    assert paged_engine(tmp_path, max_blocks=64).generate(ps, SamplingParams(max_tokens=MAX_TOKENS)) == want


def test_sharded_checkpoint_follows_its_index_beside_a_stray_consolidated_file(tmp_path):
    model = build("mistral", seed=9)
    save(model, tmp_path, shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # Mistral's own layout beside it, as Mistral repositories ship it: not for transformers' loader
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(tmp_path / "consolidated.safetensors"))
    check_parity(model, tmp_path, seed=2)
    (tmp_path / sorted(index["weight_map"].values())[0]).rename(tmp_path / "elsewhere.bin")
    with pytest.raises(ValueError, match="names files that are not there"):
        paged_engine(tmp_path)


def test_single_file_beside_a_stray_consolidated_file(tmp_path):
    model = build("llama", seed=4)
    save(model, tmp_path)
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(tmp_path / "consolidated.safetensors"))
    check_parity(model, tmp_path, seed=11)
