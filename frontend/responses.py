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

    def __init__(self, chat: bool, model: str, want_logprobs: bool, token_ids: bool = False) -> None:
        """``token_ids``: vLLM's ``return_token_ids`` (the prompt's and each choice's token ids)."""
        self.chat, self.model, self.want_logprobs, self.token_ids = chat, model, want_logprobs, token_ids
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
            choice = {"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason,
                      "stop_reason": d.stop_reason}
            if self.token_ids:
                choice["token_ids"] = d.token_ids
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
            if self.token_ids and d.prompt_token_ids is not None:
                out["prompt_token_ids"] = d.prompt_token_ids
            return out
        choice = {"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason,
                  "stop_reason": d.stop_reason}
        if self.token_ids:
            choice["token_ids"] = d.token_ids
            if d.prompt_token_ids is not None:
                choice["prompt_token_ids"] = d.prompt_token_ids
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, u: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": u}

    def whole(self, deltas: list[Delta], n_choices: int, u: dict) -> dict:
        texts = [""] * n_choices
        reasons: list[str | None] = [None] * n_choices
        stop_reasons: list[str | int | None] = [None] * n_choices
        lps: list[list[TokenLogprob]] = [[] for _ in range(n_choices)]
        ids: list[list[int]] = [[] for _ in range(n_choices)]
        prompts: list[list[int] | None] = [None] * n_choices
        for d in deltas:
            texts[d.index] += d.text
            lps[d.index] += d.logprobs
            ids[d.index] += d.token_ids
            reasons[d.index] = d.finish_reason or reasons[d.index]
            stop_reasons[d.index] = d.stop_reason if d.stop_reason is not None else stop_reasons[d.index]
            prompts[d.index] = d.prompt_token_ids if d.prompt_token_ids is not None else prompts[d.index]
        choices = []
        for i in range(n_choices):
            if self.chat:
                lp = chat_logprobs(lps[i]) if self.want_logprobs else None
                choice = {"index": i, "message": {"role": "assistant", "content": texts[i]},
                          "logprobs": lp, "finish_reason": reasons[i], "stop_reason": stop_reasons[i]}
            else:
                lp = completion_logprobs(lps[i], 0) if self.want_logprobs else None
                choice = {"index": i, "text": texts[i], "logprobs": lp, "finish_reason": reasons[i],
                          "stop_reason": stop_reasons[i]}
                if self.token_ids:
                    choice["prompt_token_ids"] = prompts[i]
            if self.token_ids:
                choice["token_ids"] = ids[i]
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": choices, "usage": u}
        if self.chat and self.token_ids:
            out["prompt_token_ids"] = next((p for p in prompts if p is not None), None)
        return out
