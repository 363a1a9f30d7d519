"""The front door's state: tokenizers, the worker directory, the router, metrics; and what
turns a validated request into prompt runs on workers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from kvpool.client.generate_core import MANAGER_GRACE_S
from kvpool.frontend.chat_template import TemplateError
from kvpool.frontend.directory import Directory, External, Located, Worker
from kvpool.frontend.errors import RETRY_AFTER_S, APIError, bad_param, unavailable
from kvpool.frontend.generation import PromptRun, Timing
from kvpool.frontend.metrics import FrontDoorMetrics
from kvpool.frontend.params import GenRequest
from kvpool.frontend.router import Candidate, Decision, KVRouter
from kvpool.frontend.run import Forward, Run, leading_in
from kvpool.frontend.tokenizer import Tokenizer, load_tokenizer
from kvpool.frontend.vllm_proxy import VLLMProxy
from kvpool.shared.bind import check_connect
from kvpool.shared.curve import ClientKeys
from kvpool.shared.hashing import hash_blocks

INLINE_TOKENIZE_CHARS = 8192  # prompts up to this much text are tokenized on the loop (microseconds)


@dataclass(frozen=True)
class FrontDoorConfig:
    managers: tuple[str, ...]
    policy: str = "kv-aware"
    overlap_weight: float = 2.0
    poll_s: float = 0.5
    silence_s: float = 30.0  # a worker, or one request, silent this long is taken for lost (heartbeats come each second)
    tokenizers: tuple[tuple[str, str], ...] = ()  # (model, tokenizer path) overrides
    # CURVE client keys (shared/curve.py) for the manager sockets (None: the KVPOOL_CURVE_*
    # environment, as every ManagerClient) and for the workers' generate sockets
    manager_keys: ClientKeys | None = None
    worker_keys: ClientKeys | None = None
    insecure: bool = False  # connect to non-loopback TCP endpoints without CURVE (trusted networks only)
    # kv-aware: count the prefixes of running prompts routed to a worker as its future hits
    # (frontend/router.py); False routes on the manager's locate alone (bench_router compares)
    count_routed: bool = True
    # a manager is taken for lost (new requests get 503 manager_unreachable) once its polls, or a
    # worker's heartbeats, have said so for this long: one slow answer on a loaded machine is not
    manager_grace_s: float = MANAGER_GRACE_S

    def __post_init__(self) -> None:
        if not self.managers:
            raise ValueError("give at least one manager endpoint (--manager, one per node)")
        curve = self.manager_keys is not None or ClientKeys.from_env() is not None
        for ep in (e for m in self.managers for e in m.split(",")):
            check_connect(ep, curve=curve, insecure=self.insecure, what="manager")
        if not 0.01 <= self.poll_s <= 60:
            raise ValueError(f"poll_s must be in [0.01, 60] seconds, got {self.poll_s}")
        if self.silence_s <= 0:
            raise ValueError(f"silence_s must be positive, got {self.silence_s}")
        if not 0 <= self.manager_grace_s <= 600:
            raise ValueError(f"manager_grace_s must be in [0, 600] seconds, got {self.manager_grace_s}")


class FrontDoor:
    def __init__(self, cfg: FrontDoorConfig) -> None:
        self.cfg = cfg
        self.directory = Directory(list(cfg.managers), poll_s=cfg.poll_s, silence_s=cfg.silence_s,
                                   manager_grace_s=cfg.manager_grace_s, manager_keys=cfg.manager_keys,
                                   worker_keys=cfg.worker_keys, insecure=cfg.insecure)
        self.router = KVRouter(cfg.policy, cfg.overlap_weight)
        self.metrics = FrontDoorMetrics()
        self._tokenizers: dict[str, Tokenizer] = {}
        self._overrides = dict(cfg.tokenizers)
        self.live: dict[tuple[int, str], set[PromptRun]] = {}  # running prompt runs per worker
        # the block hashes of those runs' prompts, counted, per worker: what it will soon cache
        self.routed: dict[tuple[int, str], Counter[bytes]] = {}
        self._chains: dict[PromptRun, list[bytes]] = {}  # each such run's chain
        self.proxy = VLLMProxy(self.directory, self.router, cfg.silence_s,  # models of attached vLLM servers
                               lambda model: self.tokenizer(model) if model in self._overrides else None)

    async def start(self) -> None:
        await self.directory.start()

    async def close(self) -> None:
        await self.proxy.close()
        await self.directory.close()

    def tokenizer(self, model: str) -> Tokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            try:
                tok = self._tokenizers[model] = load_tokenizer(self._overrides.get(model) or self._tokenizer_path(model))
            except ValueError as e:
                raise APIError(503, f"no tokenizer for model {model!r}: {e}; pass --tokenizer "
                                    f"{model}=PATH to kvpool serve", None, "no_tokenizer") from None
        return tok

    def _tokenizer_path(self, model: str) -> str:
        """What the workers serving ``model`` name as its tokenizer (a served name's checkpoint),
        else the model name itself (a preset or a checkpoint path)."""
        for w in self.directory.models().get(model, []):
            if w.tokenizer:
                return w.tokenizer
        return model

    def workers(self, model: str) -> list[Worker]:
        known = self.directory.models()
        if model not in known:
            raise APIError(404, f"the model {model!r} does not exist; served models: {sorted(known)}", "model",
                           "model_not_found")
        alive = self.directory.serving(model)
        if not alive:
            why = "; ".join(f"{w.name} at {w.endpoint}: {w.link.lost}" for w in known[model])
            raise APIError(503, f"no worker of {model!r} is reachable right now ({why}); retry shortly", None,
                           "no_worker", RETRY_AFTER_S)
        ready = [w for w in alive if self.directory.unavailable(w) is None]
        if not ready:  # every one behind a drain or a lost manager: no admission would come
            reasons = sorted({self.directory.unavailable(w) for w in alive})
            raise unavailable(reasons[0], f" (workers of {model!r}: {', '.join(w.name for w in alive)})")
        return ready

    async def tokenize(self, req: GenRequest, tok: Tokenizer, max_len: int) -> list[list[int]]:
        """``prompt_ids``, after refusing by size what cannot fit, and off the event loop when the
        text is big (tokenizing megabytes takes seconds: other clients and the managers' polls
        must not wait behind it)."""
        texts = [p for p in req.prompts if isinstance(p, str)]
        if req.chat:
            texts = [m.get("content", "") for m in req.messages or []]
        limit = max_len * tok.max_token_bytes if texts else 0  # more bytes than this: more than max_len tokens
        for text in texts:
            if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
                raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, your "
                                    f"request has more than {max_len} input tokens ({len(text)} characters). "
                                    "Please reduce the length of the input prompt.", "prompt" if not req.chat
                               else "messages", "context_length_exceeded")
        if sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS:
            return self.prompt_ids(req, tok)
        return await asyncio.to_thread(self.prompt_ids, req, tok)

    def prompt_ids(self, req: GenRequest, tok: Tokenizer) -> list[list[int]]:
        if req.chat:
            try:
                return [tok.encode(tok.apply_chat_template(req.messages or []))]
            except TemplateError as e:
                raise bad_param("messages", str(e)) from None
            except ValueError as e:
                raise bad_param("messages", str(e)) from None
        out = []
        for p in req.prompts:
            ids = tok.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            if any(t >= tok.vocab_size for t in ids):
                raise bad_param("prompt", f"token ids must be below the vocabulary size {tok.vocab_size}")
            out.append(ids)
        return out

    def _budget(self, req: GenRequest, ids: list[int], max_len: int) -> int:
        if len(ids) >= max_len:
            # a 400 as vLLM answers it (the openai client's BadRequestError), in vLLM's words
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, your request "
                                f"has {len(ids)} input tokens. Please reduce the length of the input prompt.",
                           "prompt", "context_length_exceeded")
        if not ids:
            raise bad_param("prompt", "the prompt is empty")
        room = max_len - len(ids)
        if req.max_tokens is None:
            return room
        if req.max_tokens > room:
            raise bad_param("max_tokens", f"max_tokens {req.max_tokens} + the prompt's {len(ids)} tokens exceed "
                                          f"the context of {max_len} tokens: ask for at most {room}")
        return req.max_tokens

    async def route(self, workers: list[Worker], ids: list[int], salt: str | None,
                    externals: list[External] = (), max_tokens: int = 16) -> tuple[Decision, list[bytes]]:
        """The worker (or, in a mixed fleet, the attached vLLM server) for one prompt, and the
        prompt's hash chain in its block size (empty unless the policy looks at caches)."""
        located: dict[tuple[int, int], Located] = {}
        routed: dict[tuple[int, str], int] = {}
        chains: dict[int, list[bytes]] = {}
        if self.router.needs_locate:
            for m, bs in sorted({(x.manager, x.block_size) for x in [*workers, *externals]}):
                full = (len(ids) - 1) // bs  # the block of the last prompt token is always recomputed
                if not full:
                    continue
                chain = chains.get(bs)
                if chain is None:
                    chain = chains[bs] = hash_blocks(ids[: full * bs], bs, cache_salt=salt)
                located[(m, bs)] = await self.directory.locate_all(m, chain)
            if self.cfg.count_routed:  # after the last await: what was routed meanwhile counts too
                for w in workers:
                    if w.block_size in chains:
                        routed[w.key] = leading_in(chains[w.block_size], self.routed.get(w.key))
        cands = [Candidate(w, (located.get((w.manager, w.block_size)) or Located()).pools.get(w.pool, 0),
                           w.link.running, self.outstanding(w.key), routed.get(w.key, 0)) for w in workers]
        cands += self.proxy.candidates(list(externals), located, chains, len(ids), max_tokens)
        full = (len(ids) - 1) // cands[0].worker.block_size
        d = self.router.choose(cands, full)
        return d, chains.get(d.worker.block_size, [])

    async def start_run(self, req: GenRequest) -> Run | Forward:
        """The request's prompt runs on workers; or, for a model that attached vLLM servers serve
        too (a mixed fleet), the server the same cost chose for it (``Forward``: the caller
        sends the body there). A request of several prompts runs on the workers only."""
        externals = self.proxy.servers(req.model) if req.model in self.directory.external_models() else []
        try:
            workers = self.workers(req.model)
        except APIError as e:
            if e.status != 503 or not externals:
                raise
            workers = []  # no worker can take it now: the model's vLLM servers do
        tok = self.tokenizer(req.model)
        max_len = min(w.max_model_len for w in workers or self.directory.models()[req.model])
        all_ids = await self.tokenize(req, tok, max_len)
        budgets = [self._budget(req, ids, max_len) for ids in all_ids]
        if len(all_ids) > 1 and workers:
            externals = []
        timing = Timing()
        run = Run(req, [], sum(len(i) for i in all_ids), timing)
        try:
            for k, (ids, budget) in enumerate(zip(all_ids, budgets)):
                d, chain = await self.route(workers, ids, req.cache_salt, externals, budget)
                if isinstance(d.worker, External):
                    return Forward(d, chain)
                params = {**req.worker_params, "max_tokens": budget}
                pr = PromptRun(tok, ids, d, n=req.n, first_index=k * req.n, stops=req.stop, params=params,
                               cache_salt=req.cache_salt, timing=timing,
                               token_ids_in_logprobs=req.token_ids_in_logprobs, silence_s=self.cfg.silence_s,
                               manager_grace_s=self.cfg.manager_grace_s)
                run.runs.append(pr)
                self.live.setdefault(d.worker.key, set()).add(pr)  # counted at once: the next request sees it
                if chain and self.cfg.count_routed:
                    self.routed.setdefault(d.worker.key, Counter()).update(chain)
                    self._chains[pr] = chain
        except BaseException:
            self.release(run, count=False)
            raise
        return run

    def outstanding(self, key: tuple[int, str]) -> float:
        return sum(r.outstanding_blocks() for r in self.live.get(key, ()))

    def release(self, run: Run, count: bool = True) -> None:
        for r in run.runs:
            key = r.decision.worker.key
            self.live.get(key, set()).discard(r)
            if not self.live.get(key):
                self.live.pop(key, None)
            chain = self._chains.pop(r, None)
            if chain is not None:
                counts = self.routed[key]
                for h in chain:
                    if counts[h] > 1:
                        counts[h] -= 1
                    else:
                        del counts[h]
                if not counts:
                    del self.routed[key]
        if not count:
            return
        self.metrics.count_tokens(run.prompt_tokens, run.completion_tokens, run.cached_tokens)
