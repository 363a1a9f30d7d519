"""OpenAI response bodies: completions and chat completions, whole and as stream chunks."""

from __future__ import annotations

import time
import uuid

from kvpool.frontend.generation import Delta, TokenLogprob


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """Legacy completions shape: parallel lists."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({t: lp for _, t, lp in e.top})
        out["text_offset"].append(offset)
        offset += len(e.text)
    return out


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def one(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.text, e.logprob), "top_logprobs": [one(t, lp) for _, t, lp in e.top]}
                        for e in entries]}


class ResponseBuilder:
    """Chunks of one streamed response, or the whole response, in the request's shape."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool) -> None:
        self.chat, self.model, self.want_logprobs = chat, model, want_logprobs
        self.id, self.created = new_id(chat), int(time.time())
        self.offsets: dict[int, int] = {}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self, index: int) -> dict:
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, d: Delta) -> dict:
        lps = None
        if self.want_logprobs and d.logprobs:
            if self.chat:
                lps = chat_logprobs(d.logprobs)
            else:
                lps = completion_logprobs(d.logprobs, self.offsets.get(d.index, 0))
        self.offsets[d.index] = self.offsets.get(d.index, 0) + len(d.text)
        if self.chat:
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, u: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": u}

    def whole(self, deltas: list[Delta], n_choices: int, u: dict) -> dict:
        texts = [""] * n_choices
        reasons: list[str | None] = [None] * n_choices
        lps: list[list[TokenLogprob]] = [[] for _ in range(n_choices)]
        for d in deltas:
            texts[d.index] += d.text
            lps[d.index] += d.logprobs
            reasons[d.index] = d.finish_reason or reasons[d.index]
        choices = []
        for i in range(n_choices):
            if self.chat:
                lp = chat_logprobs(lps[i]) if self.want_logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": lp, "finish_reason": reasons[i]})
            else:
                lp = completion_logprobs(lps[i], 0) if self.want_logprobs else None
                choices.append({"index": i, "text": texts[i], "logprobs": lp, "finish_reason": reasons[i]})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": u}
