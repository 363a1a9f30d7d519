"""The sampler against the real other sides: vLLM 0.33.0's own penalty and min_p code (loaded
from its wheel, as the event-struct tests load theirs), its temperature rules, its seeds for
parallel samples; and transformers' min_new_tokens on a checkpoint whose eos is a list."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.hf import build, hf_greedy, prompts, save
from helpers.vllm_structs import vllm_tree
from helpers.worker import make_engine, make_prompt

from kvpool.shared.sampling import MIN_TEMPERATURE, SAMPLING_EPS
from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import WorkerConfig
from kvpool.worker.sampler import SampleKey, SamplingParams, sample
from kvpool.worker.sampler import _process as process
from kvpool.worker.startup import build_engine


@pytest.fixture(scope="module")
def vllm033() -> Path:
    tree = vllm_tree("0.33.0")
    assert tree is not None, "could not fetch the vllm 0.33.0 wheel (pip download --no-deps)"
    return tree / "vllm"


def _function(source: str, name: str, cls: str | None = None) -> str:
    """The source of function ``name`` (a method of ``cls``) in ``source``, dedented."""
    tree = ast.parse(source)
    scope = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    return textwrap.dedent(ast.get_source_segment(source, node))


def _constants(source: str, *names: str) -> dict[str, float]:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def test_the_repetition_penalty_is_vllms(vllm033: Path) -> None:
    ns: dict = {"torch": torch}
    exec(_function((vllm033 / "_custom_ops.py").read_text(), "apply_repetition_penalties_torch"), ns)
    vllm_apply = ns["apply_repetition_penalties_torch"]
    g = torch.Generator().manual_seed(0)
    vocab, rows = 40, 4
    logits = torch.randn(rows, vocab, generator=g) * 3
    penalties = [0.5, 1.3, 2.0, 1.0]
    prompt_ids = [[1, 2, 3, 9], [5, 5, 6], [7], [8, 9]]
    output_ids = [[3, 4], [], [7, 30, 31], [2]]
    prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    output_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    for r in range(rows):
        prompt_mask[r, prompt_ids[r]] = True
        if output_ids[r]:
            output_mask[r, output_ids[r]] = True
    want = logits.clone()
    vllm_apply(want, prompt_mask, output_mask, torch.tensor(penalties))
    for r in range(rows):
        key = SampleKey(SamplingParams(repetition_penalty=penalties[r]), 0, 0, len(output_ids[r]),
                        output=output_ids[r], prompt=prompt_ids[r])
        torch.testing.assert_close(process(logits[r], key), want[r])


def test_min_p_keeps_the_tokens_vllm_keeps(vllm033: Path) -> None:
    ns: dict = {"torch": torch}
    src = (vllm033 / "v1/sample/logits_processor/builtin.py").read_text()
    exec(_function(src, "apply", cls="MinPLogitsProcessor"), ns)
    logits = torch.log(torch.tensor([[0.40, 0.30, 0.15, 0.08, 0.05, 0.02]]))
    for min_p in (0.1, 0.3, 0.6):
        state = SimpleNamespace(min_p_count=1, min_p=torch.tensor([[min_p]]))
        kept = set(torch.isfinite(ns["apply"](state, logits.clone())[0]).nonzero().flatten().tolist())
        p = SamplingParams(temperature=1.0, min_p=min_p)
        drawn = {sample(logits, [SampleKey(p, seed, 0, 0)])[0] for seed in range(600)}
        assert drawn == kept, (min_p, drawn, kept)


def test_temperature_rules_are_vllms(vllm033: Path) -> None:
    consts = _constants((vllm033 / "sampling_params.py").read_text(), "_SAMPLING_EPS", "_MAX_TEMP")
    assert (SAMPLING_EPS, MIN_TEMPERATURE) == (consts["_SAMPLING_EPS"], consts["_MAX_TEMP"])
    # vLLM raises a temperature in (0, 0.01) to 0.01 before deciding greedy (temperature < 1e-5)
    tiny = SamplingParams(temperature=1e-6)
    assert tiny.temperature == MIN_TEMPERATURE and not tiny.greedy
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy


def test_sample_i_of_n_draws_as_the_request_with_seed_plus_i() -> None:
    """vLLM gives parallel sample i the seed seed + i (vllm/v1/engine/parallel_sampling.py)."""
    engine = make_engine()
    prompt = make_prompt(12, 3)
    many = engine.generate([prompt], SamplingParams(max_tokens=10, n=3, seed=7, temperature=1.0, ignore_eos=True))[0]
    for i in range(3):
        alone = engine.generate([prompt], SamplingParams(max_tokens=10, seed=7 + i, temperature=1.0, ignore_eos=True))
        assert many[i] == alone[0][0]
    assert len({tuple(s) for s in many}) > 1


def test_repetition_penalty_changes_greedy_output_over_the_prompt() -> None:
    engine = make_engine()

    def repeats(prompt: list[int], out: list[int]) -> bool:
        return bool(set(out) & set(prompt)) or len(set(out)) < len(out)

    # a prompt whose greedy output repeats itself or the prompt (short, repetitive prompts do)
    plain, prompt = [], []
    for seed in range(40):
        prompt = make_prompt(3, seed) * 4
        plain = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0][0]
        if repeats(prompt, plain):
            break
    assert repeats(prompt, plain)
    hard = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1e3))[0][0]
    assert not repeats(prompt, hard)  # every seen token is all but banned


def test_min_tokens_masks_every_eos_id_as_transformers_does(tmp_path) -> None:
    """A checkpoint saved by transformers whose eos is a list: min_tokens holds back all of them
    (transformers' min_new_tokens, vLLM's min_tokens), not only the first."""
    probe = build("llama", seed=5)
    ps = prompts(7)
    free = hf_greedy(probe, ps[0], 24)
    second = next(t for i, t in enumerate(free) if 2 <= i < 10 and t not in free[:i] and t > 2)
    model = build("llama", seed=5, eos=[1, second])
    save(model, tmp_path)
    ids = torch.tensor([ps[0]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=16,
                          do_sample=False)[0, len(ps[0]):].tolist()
    assert second not in want[:16]
    wc = WorkerConfig(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
                      max_model_len=72)
    engine = build_engine(wc, LocalBlockManager("eos", max_blocks=64))
    got = engine.generate([ps[0]], SamplingParams(max_tokens=24, min_tokens=16))[0][0]
    assert got == want
