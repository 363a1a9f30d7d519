"""The offline API: ``from kvpool import LLM, SamplingParams``, no server."""

from __future__ import annotations

import pytest

import kvpool
from kvpool import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", kv_cache_memory=2 << 20, max_model_len=256, dtype="float32", device="cpu")


def test_text_and_token_prompts_generate_like_the_engine(llm: LLM) -> None:
    outs = llm.generate(["naïve 🙂", [5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.prompt for o in outs] == ["naïve 🙂", None]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("naïve 🙂", add_special_tokens=True)
    for o in outs:
        (c,) = o.outputs
        assert len(c.token_ids) == 6 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)  # the streamed deltas add up to the whole
    direct = llm.engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0][0]
    assert outs[1].outputs[0].token_ids == direct  # greedy: the same tokens as the engine alone


def test_n_samples_seeded_and_per_prompt_params(llm: LLM) -> None:
    p = SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=11, ignore_eos=True)
    a = llm.generate("x", p)[0]
    b = llm.generate("x", p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    both = llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=4, ignore_eos=True)])
    assert len(both[1].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_stop_strings_end_the_text_before_them(llm: LLM) -> None:
    free = llm.generate("stop", SamplingParams(max_tokens=20, ignore_eos=True))[0].outputs[0].text
    k = next(i for i in range(3, len(free) - 1) if "\ufffd" not in free[i:i + 2])
    stop = free[k:k + 2]
    got = llm.generate("stop", SamplingParams(max_tokens=20, ignore_eos=True, stop=stop))[0].outputs[0]
    assert (got.text, got.finish_reason) == (free[: free.find(stop)], "stop")
    assert llm.engine.stats()["running"] == 0 and not llm.engine.has_work()
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, logprobs=0))[0]
    assert out.prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert out.prompt_token_ids[0] == 2 and len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)


def test_the_top_level_package_exports_only_the_offline_api() -> None:
    assert kvpool.LLM is LLM and set(kvpool.__all__) == {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput"}
    with pytest.raises(AttributeError):
        kvpool.nothing  # noqa: B018
