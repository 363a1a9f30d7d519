"""OpenAI request bodies -> typed records, every check in one place (400 with the param named).

Accepted as in OpenAI's API (and vLLM's extensions, marked *): ``model``, ``prompt`` (text, token
ids, or a list of either: a batch) / ``messages``, ``max_tokens`` (``max_completion_tokens`` for
chat), ``temperature``, ``top_p``, ``top_k``*, ``min_p``*, ``min_tokens``*, ``seed``, ``n``,
``stop``, ``stop_token_ids``*, ``ignore_eos``*, ``logprobs`` (completions: an int 0-5; chat: a
bool with ``top_logprobs`` 0-20), ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``*, ``stream``, ``stream_options.include_usage``, ``cache_salt``*,
``return_tokens_as_token_ids``* (logprob tokens read ``token_id:N``), ``return_token_ids``* (the
prompt's and each choice's token ids come back). Accepted and without effect here, by meaning:
``user``, ``request_id``*, ``session_id``*, ``best_of`` equal to n; ``priority``* (an int, vLLM's
meaning: lower is more important) orders what the node tier keeps, not the scheduling.

Every other field of vLLM 0.33's CompletionRequest and ChatCompletionRequest
(vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py) is refused with a
400 naming it when it asks for anything but its default (``VLLM_ONLY``), never ignored: a
client relying on it would get silently different output. Fields neither API defines are
ignored, as vLLM ignores them (OpenAI's clients send extras). README.md's parameter table is
this module's list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.frontend.errors import bad_param

MAX_N = 64
MAX_STOP = 16
MAX_CHOICES = 256  # prompts in a batch times n


@dataclass
class GenRequest:
    """One /v1/completions or /v1/chat/completions request, validated."""

    chat: bool
    model: str
    prompts: list[str | list[int]]  # text to tokenize, or token ids (completions)
    messages: list[dict] | None
    max_tokens: int | None  # None: up to max_model_len
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token (None: no logprobs)
    cache_salt: str | None = None
    token_ids_in_logprobs: bool = False
    return_token_ids: bool = False
    worker_params: dict = field(default_factory=dict)  # for the worker's SamplingParams


def _num(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    v = body.get(key, default)
    if v is None:
        return default
    if type(v) not in (int, float) or not lo <= v <= hi:
        raise bad_param(key, f"{key} must be a number in [{lo}, {hi}], got {v!r:.40}")
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if type(v) is not int or not lo <= v <= hi:
        raise bad_param(key, f"{key} must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if type(v) is not bool:
        raise bad_param(key, f"{key} must be true or false, got {v!r:.40}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if type(stops) is not list or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad_param("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} of them")
    return stops


def _token_list(v: Any) -> bool:
    return type(v) is list and len(v) > 0 and all(type(t) is int and t >= 0 for t in v)


def _prompts(body: dict) -> list[str | list[int]]:
    v = body.get("prompt")
    if isinstance(v, str):
        return [v]
    if _token_list(v):
        return [v]
    if type(v) is list and v and all(isinstance(p, str) or _token_list(p) for p in v):
        return list(v)
    raise bad_param("prompt", "prompt must be a string, a list of token ids, or a non-empty list of either")


def chat_messages(body: dict) -> list[dict]:
    """``messages``, checked: each a string role and text content (content parts joined)."""
    msgs = body.get("messages")
    if type(msgs) is not list or not msgs:
        raise bad_param("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        if type(m) is not dict or not isinstance(m.get("role"), str):
            raise bad_param(f"messages[{i}]", "every message needs a string role")
        content = m.get("content", "")
        if type(content) is list:  # OpenAI's content parts: only text parts can be served here
            if not all(type(p) is dict and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad_param(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_param(f"messages[{i}].content", "content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


_UNSET = (None, False, {}, [], "")  # what a client sends for "not asked for"
# Fields of vLLM 0.33's request models that kvpool does not implement: the values that ask for
# nothing (besides _UNSET). Any other value is a 400 that names the field.
VLLM_ONLY: dict[str, tuple] = {
    "echo": (), "logit_bias": (), "suffix": (), "tools": (), "functions": (), "function_call": ("none",),
    "tool_choice": ("none",), "parallel_tool_calls": (True,), "response_format": ({"type": "text"},),
    "structured_outputs": (), "use_beam_search": (), "length_penalty": (1, 1.0), "watermarking": (),
    "include_stop_str_in_output": (), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (), "truncation_side": (), "allowed_token_ids": (), "prompt_logprobs": (),
    "logprob_token_ids": (), "bad_words": (), "prompt_embeds": (), "add_special_tokens": (),
    "return_weight_versions": (), "routed_experts_prompt_start": (0,), "return_token_offsets": (),
    "return_prompt_text": (), "mm_payload": (), "return_mm_kwargs": (), "kv_transfer_params": (),
    "ec_transfer_params": (), "vllm_xargs": (), "repetition_detection": (), "thinking_token_budget": (),
    "stream_interval": (1,), "reasoning_effort": (), "include_reasoning": (True,), "documents": (),
    "chat_template": (), "chat_template_kwargs": (), "media_io_kwargs": (), "mm_processor_kwargs": (),
    "add_generation_prompt": (True,), "continue_final_message": (),
}
NO_EFFECT = ("user", "request_id", "session_id")  # accepted whatever they say: nothing to do here


def _refuse_unsupported(body: dict, chat: bool) -> None:
    for key, fine in VLLM_ONLY.items():
        if key not in body:
            continue
        v = body[key]
        if key == "add_special_tokens":  # completions add them (True), chat templates do not (False)
            fine = (not chat,)
        if (v in _UNSET and type(v) is not int) or any(v == f and type(v) is type(f) for f in fine):
            continue
        raise bad_param(key, f"{key} is not supported by kvpool (README.md lists the parameters it serves); "
                             f"leave it out or at its default")


def parse_request(body: Any, chat: bool) -> GenRequest:
    if type(body) is not dict:
        raise bad_param("body", "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "model must name a served model (GET /v1/models lists them)")
    _refuse_unsupported(body, chat)
    n = _int(body, "n", 1, MAX_N, 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_param("best_of", "best_of other than n is not supported")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, 1, 1 << 24, None if chat else 16)
    if chat:
        lp = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, 20, 0)
        logprobs = top if lp else None
        if top and not lp:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        logprobs = _int(body, "logprobs", 0, 5, None)
    top_k = _int(body, "top_k", -1, 1 << 20, 0)
    wp: dict[str, Any] = {
        "temperature": _num(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _num(body, "top_p", 1e-9, 1.0, 1.0),
        "top_k": 0 if top_k == -1 else top_k,
        "min_tokens": _int(body, "min_tokens", 0, 1 << 24, 0),
        "presence_penalty": _num(body, "presence_penalty", -2.0, 2.0, 0.0),
        "frequency_penalty": _num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        "repetition_penalty": _repetition(body),
        "min_p": _num(body, "min_p", 0.0, 1.0, 0.0),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "n": n,
    }
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1, None)
    if seed is not None:
        wp["seed"] = seed % (1 << 63)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if type(ids) is not list or not all(type(t) is int and t >= 0 for t in ids) or len(ids) > 64:
            raise bad_param("stop_token_ids", "stop_token_ids must be a list of at most 64 token ids")
        wp["stop_token_ids"] = ids
    if logprobs is not None:
        wp["logprobs"] = logprobs
    if max_tokens is not None and wp["min_tokens"] > max_tokens:
        raise bad_param("min_tokens", f"min_tokens {wp['min_tokens']} exceeds max_tokens {max_tokens}")
    priority = body.get("priority", 0)
    if type(priority) is not int or not -(1 << 31) <= priority < 1 << 31:
        raise bad_param("priority", "priority must be an int in [-2**31, 2**31)")
    if priority:
        wp["priority"] = priority
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= 256):
        raise bad_param("cache_salt", "cache_salt must be a string of 1-256 characters")
    opts = body.get("stream_options") or {}
    if type(opts) is not dict:
        raise bad_param("stream_options", "stream_options must be an object")
    prompts = [] if chat else _prompts(body)
    if len(prompts) * n > MAX_CHOICES:
        raise bad_param("prompt", f"{len(prompts)} prompts x n={n} choices; at most {MAX_CHOICES} per request")
    return GenRequest(chat=chat, model=model, prompts=prompts,
                      messages=chat_messages(body) if chat else None, max_tokens=max_tokens, n=n, stop=_stop(body),
                      stream=_bool(body, "stream", False), include_usage=_bool(opts, "include_usage", False),
                      logprobs=logprobs, cache_salt=salt,
                      token_ids_in_logprobs=_bool(body, "return_tokens_as_token_ids", False),
                      return_token_ids=_bool(body, "return_token_ids", False), worker_params=wp)


def _repetition(body: dict) -> float:
    v = body.get("repetition_penalty")
    if v is None:
        return 1.0
    if type(v) not in (int, float) or not 0 < v <= 1e4:
        raise bad_param("repetition_penalty", f"repetition_penalty must be a number in (0, 10000] (1 is off), "
                                              f"got {v!r:.40}")
    return float(v)
