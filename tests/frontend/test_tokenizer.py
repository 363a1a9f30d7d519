"""Tokenizers, chat templates (against transformers' apply_chat_template) and streaming detokenization."""

from __future__ import annotations

import pytest
from helpers.tokenizers import make_tokenizer_dir

from kvpool.frontend.chat_template import TemplateError
from kvpool.frontend.detokenizer import IncrementalDetokenizer
from kvpool.frontend.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["plain ascii", "naïve café Straße", "日本語のテキスト", "🙂🚀 mixed ∑ text", ""]
MESSAGES = [
    [{"role": "user", "content": "héllo 🙂"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語?"},
     {"role": "assistant", "content": "はい"}, {"role": "user", "content": "ok", "meta": {"k": "ü"}}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_multibyte_text(text: str) -> None:
    tok = load_tokenizer("tiny")
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True)[0] == tok.special.bos_id


def test_byte_tokenizer_special_tokens_in_text_and_unused_ids() -> None:
    tok = ByteTokenizer(512)
    assert tok.encode("<s>a</s>") == [2, ord("a") + 3, 1]
    assert tok.decode([2, ord("a") + 3, 1]) == "a"
    assert tok.decode([2, 1], skip_special_tokens=False) == "<s></s>"
    assert tok.decode([259, 260]) == "!\""  # ids past the bytes (seeded weights) stay printable
    with pytest.raises(ValueError, match="259"):
        ByteTokenizer(100)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trips_multibyte_text(tok_dir: str, text: str) -> None:
    tok = HFTokenizer(tok_dir)
    assert tok.decode(tok.encode(text)) == text


def test_unknown_model_and_missing_tokenizer_say_what_to_do(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_tokenizer("no-such-model")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(tok_dir: str, messages: list, add_generation_prompt: bool) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    ours = HFTokenizer(tok_dir)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert "<|im_start|>" in got and ("ü" in got) == (len(messages) > 1)  # tojson kept non-ASCII
    want_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                       return_dict=False)
    assert ours.encode(got) == list(want_ids)


def test_chat_template_raise_exception_is_a_template_error(tok_dir: str) -> None:
    with pytest.raises(TemplateError, match="unknown role tool"):
        HFTokenizer(tok_dir).apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("text", TEXTS[:4])
@pytest.mark.parametrize("which", ["bytes", "hf"])
def test_incremental_detokenizer_never_splits_a_character(tok_dir: str, text: str, which: str) -> None:
    tok = ByteTokenizer(512) if which == "bytes" else HFTokenizer(tok_dir)
    prompt = tok.encode("context: ")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in tok.encode(text)] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    if which == "bytes" and text != "plain ascii":
        assert "" in deltas[:-1]  # a multi-byte character was held back, then released whole


def test_incremental_detokenizer_releases_invalid_bytes_eventually() -> None:
    tok = ByteTokenizer(512)
    detok = IncrementalDetokenizer(tok, [])
    bad = [0xE6 + 3] * 8  # lead bytes that never complete
    out = "".join(detok.add(t) for t in bad) + detok.flush()
    assert out.count("\ufffd") == 8


def test_both_tokenizers_refuse_a_lone_surrogate_with_a_value_error(tok_dir: str) -> None:
    for tok in (ByteTokenizer(), HFTokenizer(tok_dir)):
        with pytest.raises(ValueError, match="surrogate"):
            tok.encode("ok \ud800")
        assert tok.decode(tok.encode("ok \U0001f600")) == "ok \U0001f600"


def test_a_stream_ending_inside_a_character_releases_its_bytes_as_replacement_marks() -> None:
    """README's documented difference from vLLM (whose decode stream drops them): the text is
    complete up to the character, and the incomplete bytes come out as U+FFFD, never silently."""
    tok = ByteTokenizer(512)
    detok = IncrementalDetokenizer(tok, [])
    ids = tok.encode(" 😀") + tok.encode("😀")[:2]  # a whole emoji, then half of another
    out = "".join(detok.add(t) for t in ids)
    assert out == " 😀"
    tail = detok.flush()
    assert tail and set(tail) == {"\ufffd"}
