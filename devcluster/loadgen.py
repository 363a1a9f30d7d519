"""A multi-tenant chat trace and an HTTP load generator for the front door (the demo and
scripts/bench_router.py): each tenant has its own long system prompt and cache salt; requests
stream, so time to first token is measured at the client, as ``vllm bench serve`` does."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from kvpool.bench.workload import WORDS, TraceRequest, chat_messages


@dataclass(frozen=True)
class ChatTraceConfig:
    num_requests: int = 200
    num_tenants: int = 4
    system_words: tuple[int, int] = (12, 24)  # words of a tenant's system prompt (~7 bytes a word)
    user_words: tuple[int, int] = (2, 16)
    max_tokens: tuple[int, int] = (8, 48)
    parallel_every: int = 8  # every k-th request asks for n=2 samples (0: never)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_tenants < 1:
            raise ValueError("num_requests and num_tenants must be >= 1")
        for key in ("system_words", "user_words", "max_tokens"):
            lo, hi = getattr(self, key)
            if not 1 <= lo <= hi:
                raise ValueError(f"{key} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")


def _word_ids(rng: random.Random, span: tuple[int, int]) -> list[int]:
    return [rng.randrange(len(WORDS)) for _ in range(rng.randint(*span))]


def chat_trace(cfg: ChatTraceConfig) -> list[TraceRequest]:
    """The trace as kvpool.bench's records: a prompt is its tenant's system-prompt words, then
    the user's (``chat_messages`` renders them); ``out_lens`` its ``max_tokens`` per sample."""
    rng = random.Random(cfg.seed)
    systems = [_word_ids(rng, cfg.system_words) for _ in range(cfg.num_tenants)]
    out = []
    for i in range(cfg.num_requests):
        t = rng.randrange(cfg.num_tenants)
        user = _word_ids(rng, cfg.user_words)
        n = 2 if cfg.parallel_every and i % cfg.parallel_every == cfg.parallel_every - 1 else 1
        out_lens = (rng.randint(*cfg.max_tokens),) * n
        out.append(TraceRequest(i, 0, tuple(systems[t] + user), out_lens, len(systems[t]), t, seed=i))
    return out


@dataclass
class Result:
    tenant: int
    status: int
    ttft_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the front door's locate figure for the chosen worker
    worker: str = ""
    texts: list[str] = field(default_factory=list)


async def _one(client: httpx.AsyncClient, model: str, req: TraceRequest, salted: bool) -> Result:
    body = {"model": model, "messages": chat_messages(req), "max_tokens": req.max_tokens, "n": req.n, "seed": req.seed,
            "temperature": 0.8, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if salted:
        body["cache_salt"] = f"tenant-{req.group}"
    res = Result(req.group, 0, texts=[""] * req.n)
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        res.status, res.worker = r.status_code, r.headers.get("x-kvpool-worker", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.status = 599
                continue
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    res.ttft_s = res.ttft_s if res.ttft_s is not None else time.perf_counter() - t0
                    res.texts[c["index"]] += c["delta"]["content"]
            if chunk.get("usage"):
                u = chunk["usage"]
                res.prompt_tokens, res.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                res.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
    res.e2e_s = time.perf_counter() - t0
    return res


async def drive(url: str, model: str, trace: list[TraceRequest], *, max_inflight: int = 32, salted: bool = True,
                progress: bool = False) -> tuple[list[Result], float]:
    """Sends the trace with at most ``max_inflight`` open streams; (results in trace order, seconds)."""
    gate = asyncio.Semaphore(max_inflight)
    bar = tqdm(total=len(trace), desc="requests", unit="req", disable=not progress)

    async def gated(client: httpx.AsyncClient, req: TraceRequest) -> Result:
        async with gate:
            res = await _one(client, model, req, salted)
            bar.update(1)
            return res

    limits = httpx.Limits(max_connections=max_inflight + 8)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        results = await asyncio.gather(*(gated(client, r) for r in trace))
    bar.close()
    return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(max(int(q) - 1, 0), 98)]


def summarize(results: list[Result], elapsed_s: float) -> dict:
    ok = [r for r in results if r.status == 200]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    failed: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            failed[str(r.status)] = failed.get(str(r.status), 0) + 1
    return {"requests": len(results), "failed": len(results) - len(ok), "failed_by_status": failed,
            "elapsed_s": round(elapsed_s, 3),
            "generated_tokens": tokens, "tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s else 0.0,
            "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else 0.0,
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "routed_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0}
