"""Request validation and stop-string cutting, without a server."""

from __future__ import annotations

import pytest

from kvpool.frontend.errors import APIError
from kvpool.frontend.generation import cut_at_stop
from kvpool.frontend.params import parse_request


def bad(body: dict, chat: bool = False) -> APIError:
    with pytest.raises(APIError) as ei:
        parse_request({"model": "m", **body}, chat)
    assert ei.value.status == 400 and ei.value.body()["error"]["type"] == "invalid_request_error"
    return ei.value


def test_completion_defaults_and_vllm_extras() -> None:
    r = parse_request({"model": "m", "prompt": "x"}, chat=False)
    assert (r.max_tokens, r.n, r.stream, r.logprobs, r.stop) == (16, 1, False, None, [])
    assert r.worker_params["temperature"] == 1.0 and r.worker_params["top_k"] == 0
    r = parse_request({"model": "m", "prompt": [[1, 2], "y"], "top_k": -1, "seed": -1, "stop": "END",
                       "min_tokens": 2, "stop_token_ids": [7], "cache_salt": "t", "logprobs": 3}, chat=False)
    assert r.prompts == [[1, 2], "y"] and r.worker_params["top_k"] == 0 and 0 <= r.worker_params["seed"] < 1 << 63
    assert r.stop == ["END"] and r.worker_params["stop_token_ids"] == [7] and r.worker_params["logprobs"] == 3
    assert r.cache_salt == "t"


def test_chat_fields() -> None:
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}],
                       "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2,
                       "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    assert r.messages == [{"role": "user", "content": "ab"}] and r.max_tokens == 5 and r.logprobs == 2
    assert r.stream and r.include_usage
    assert parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, chat=True).max_tokens is None


@pytest.mark.parametrize("body,chat,param", [
    ({"messages": []}, True, "messages"),
    ({"messages": [{"content": "x"}]}, True, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs"),
    ({"prompt": "x", "best_of": 3}, False, "best_of"),
    ({"prompt": "x", "echo": True}, False, "echo"),
    ({"prompt": ["x"] * 5, "n": 64}, False, "prompt"),
    ({"prompt": "x", "logprobs": 6}, False, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, False, "stream"),
    ({"prompt": "x", "cache_salt": ""}, False, "cache_salt"),
    ({"prompt": "x", "stop_token_ids": [-1]}, False, "stop_token_ids"),
    ({"prompt": []}, False, "prompt"),
])
def test_bad_fields_name_their_param(body: dict, chat: bool, param: str) -> None:
    assert bad(body, chat).param == param


def test_model_is_required() -> None:
    with pytest.raises(APIError) as ei:
        parse_request({"prompt": "x"}, chat=False)
    assert ei.value.param == "model"
    with pytest.raises(APIError):
        parse_request(["not", "an", "object"], chat=False)


def test_cut_at_stop_holds_back_what_may_begin_a_stop() -> None:
    assert cut_at_stop("hello wor", ["world"], final=False) == ("hello", False, " wor")
    assert cut_at_stop("hello world!", ["world"], final=False) == ("hello ", True, "")
    assert cut_at_stop("hello wor", ["world"], final=True) == ("hello wor", False, "")
    assert cut_at_stop("abc", [], final=False) == ("abc", False, "")
    assert cut_at_stop("xAyB", ["B", "Ay"], final=False) == ("x", True, "")  # the earliest stop wins


def test_vllm_sampling_extras_are_parsed() -> None:
    r = parse_request({"model": "m", "prompt": "x", "repetition_penalty": 1.2, "min_p": 0.05,
                       "return_token_ids": True}, chat=False)
    assert (r.worker_params["repetition_penalty"], r.worker_params["min_p"], r.return_token_ids) == (1.2, 0.05, True)
    r = parse_request({"model": "m", "prompt": "x"}, chat=False)
    assert (r.worker_params["repetition_penalty"], r.worker_params["min_p"], r.return_token_ids) == (1.0, 0.0, False)
    assert bad({"prompt": "x", "repetition_penalty": 0}).param == "repetition_penalty"
    assert bad({"prompt": "x", "min_p": 1.5}).param == "min_p"


def test_every_vllm_field_is_served_or_refused_by_name() -> None:
    """Defaults of vLLM-only fields pass (clients send them); anything else is a 400 naming it."""
    from kvpool.frontend.params import VLLM_ONLY

    defaults = {"use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True,
                "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "bad_words": [],
                "add_special_tokens": True, "priority": 0, "response_format": {"type": "text"}}
    parse_request({"model": "m", "prompt": "x", **defaults, "user": "u", "request_id": "r"}, chat=False)
    for key in VLLM_ONLY:
        assert bad({"prompt": "x", key: "surely not a default"}).param == key
    assert bad({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, chat=True).param == \
        "add_special_tokens"
