"""The front door's Prometheus metrics: latency histograms, requests by status, tokens, routing."""

from __future__ import annotations

from collections import Counter

from kvpool.frontend.generation import Timing
from kvpool.frontend.router import KVRouter
from kvpool.shared.metrics import Histogram, family, histogram_family

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class FrontDoorMetrics:
    def __init__(self) -> None:
        self.ttft, self.itl, self.e2e = Histogram(SECONDS), Histogram(SECONDS), Histogram(SECONDS)
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, status) -> n
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0  # prompt tokens the chosen worker held when routed (manager's locate)

    def count_tokens(self, prompt: int, generation: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generation
        self.cached_tokens += cached

    def finished(self, endpoint: str, status: str, timing: Timing | None = None) -> None:
        self.requests[(endpoint, status)] += 1
        if timing is None:
            return
        if timing.first is not None:
            self.ttft.observe(timing.first - timing.start)
        for gap in timing.gaps:
            self.itl.observe(gap)
        self.e2e.observe((timing.last or timing.start) - timing.start)

    def render(self, router: KVRouter, workers: dict[str, int]) -> str:
        parts = [
            histogram_family("kvpool_frontdoor_time_to_first_token_seconds", "Time to first token.",
                             [({}, self.ttft)]),
            histogram_family("kvpool_frontdoor_inter_token_latency_seconds", "Time between tokens of a request.",
                             [({}, self.itl)]),
            histogram_family("kvpool_frontdoor_e2e_request_latency_seconds", "Request start to last token.",
                             [({}, self.e2e)]),
            family("kvpool_frontdoor_requests_total", "counter", "Requests by endpoint and final status.",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())]),
            family("kvpool_frontdoor_prompt_tokens_total", "counter", "Prompt tokens.", [({}, self.prompt_tokens)]),
            family("kvpool_frontdoor_generation_tokens_total", "counter", "Generated tokens.",
                   [({}, self.generation_tokens)]),
            family("kvpool_frontdoor_routed_cached_tokens_total", "counter",
                   "Prompt tokens cached on the chosen worker when routed.", [({}, self.cached_tokens)]),
            family("kvpool_frontdoor_routing_decisions_total", "counter", "Routing decisions by reason.",
                   [({"policy": router.policy, "reason": r}, n) for r, n in sorted(router.decisions.items())]),
            family("kvpool_frontdoor_routed_requests_total", "counter", "Requests routed to each worker.",
                   [({"worker": w}, n) for w, n in sorted(router.per_worker.items())]),
            family("kvpool_frontdoor_worker_running", "gauge", "Requests running on each worker.",
                   [({"worker": w}, n) for w, n in sorted(workers.items())]),
        ]
        return "".join(parts)
