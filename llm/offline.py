"""The offline API: ``LLM(model).generate(prompts, params)`` with no manager or worker process.

The engine is the worker's (worker/engine.py) over an in-process block manager (the manager's
pool core); text goes through the same tokenizers and stop-string handling as the front door.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from kvpool.frontend.detokenizer import IncrementalDetokenizer
from kvpool.frontend.generation import cut_at_stop
from kvpool.frontend.tokenizer import load_tokenizer
from kvpool.worker.sampler import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None  # of each generated token, when params.logprobs is set


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """A model, its tokenizer and an engine with its KV cache, in this process."""

    def __init__(self, model: str = "tiny", *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", seed: int = 0, block_size: int = 16, max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True, **engine_options: object) -> None:
        from kvpool.worker.block_manager import LocalBlockManager
        from kvpool.worker.config import WorkerConfig
        from kvpool.worker.startup import build_engine

        cfg = WorkerConfig(model=model, dtype=dtype, device=device, seed=seed, block_size=block_size,
                           max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                           enable_prefix_caching=enable_prefix_caching, **engine_options)  # type: ignore[arg-type]
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.engine = build_engine(cfg, LocalBlockManager("offline", enable_caching=enable_prefix_caching))
        self._next = 0

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or several, through the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self._run(texts, [self.tokenizer.encode(t) for t in texts], params, use_tqdm)

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Texts (tokenized with the model's tokenizer, bos added) or token-id lists, to completion."""
        if isinstance(prompts, str):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
               for p in prompts]
        return self._run(texts, ids, params, use_tqdm)

    def _run(self, texts: list[str | None], ids: list[list[int]],
             params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool) -> list[RequestOutput]:
        per = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(ids)
        if len(per) != len(ids):
            raise ValueError(f"{len(per)} SamplingParams for {len(ids)} prompts: give one, or one per prompt")
        outs: dict[str, RequestOutput] = {}
        state: dict[str, list[_Sample]] = {}
        for text, prompt, p in zip(texts, ids, per):
            rid = f"offline-{self._next}"
            self._next += 1
            self.engine.add_request(prompt, p, request_id=rid)
            outs[rid] = RequestOutput(rid, text, prompt)
            state[rid] = [_Sample(IncrementalDetokenizer(self.tokenizer, prompt), p.stop)
                          for _ in range(p.n)]
        bar = tqdm(total=len(outs), desc="prompts", disable=not use_tqdm)
        done: set[str] = set()
        while self.engine.has_work():
            for ev in self.engine.step():
                samples = state[ev.request_id]
                samples[ev.index].take(ev)
                if ev.request_id not in done and all(s.reason is not None for s in samples):
                    done.add(ev.request_id)
                    self.engine.abort(ev.request_id)  # samples that met a stop string: free the blocks now
                    bar.update(1)
        bar.close()
        for rid, out in outs.items():
            out.outputs = [CompletionOutput(i, s.text, s.tokens, s.reason, s.logprobs)
                           for i, s in enumerate(state[rid])]
        return list(outs.values())


class _Sample:
    def __init__(self, detok: IncrementalDetokenizer, stops: tuple[str, ...]) -> None:
        self.detok, self.stops = detok, list(stops)
        self.text, self.held = "", ""
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = None
        self.reason: str | None = None

    def take(self, ev) -> None:
        if self.reason is not None:
            return
        delta = ""
        if ev.token is not None:
            self.tokens.append(ev.token)
            delta = self.detok.add(ev.token)
            if ev.logprob is not None:
                self.logprobs = (self.logprobs or []) + [ev.logprob]
        if ev.finished:
            delta += self.detok.flush()
        out, stopped, self.held = cut_at_stop(self.held + delta, self.stops, ev.finished)
        self.text += out
        if stopped:
            self.reason = "stop"
        elif ev.finished:
            self.reason = ev.finish_reason
