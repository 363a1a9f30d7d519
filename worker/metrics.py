"""A worker's Prometheus metrics: rendered by the worker loop, served by a daemon HTTP thread.

Throughput gauges are rates over the last ``window_s`` seconds of renders (the loop renders at
most every ``interval_s``), so a scrape sees tokens/s without Prometheus having to ``rate()``
the counters (which are exported too).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from kvpool.shared.metrics import Histogram, MetricsServer, family, histogram_family

logger = logging.getLogger(__name__)


class WorkerMetrics:
    def __init__(self, pool: str, host: str, port: int, *, interval_s: float = 0.5, window_s: float = 10.0) -> None:
        self.pool = pool
        self.interval_s, self.window_s = interval_s, window_s
        self.generated_tokens = 0  # sampled tokens sent to clients (the loop counts them)
        self.step_latency = Histogram()
        self.server = MetricsServer(host, port)
        self.port = self.server.port
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, generated, computed)
        self._next = 0.0

    def observe_step(self, seconds: float, generated: int) -> None:
        self.step_latency.observe(seconds)
        self.generated_tokens += generated

    def maybe_update(self, engine: object, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + self.interval_s
        self.server.update(self.render(engine, now))
        return True

    def _rates(self, now: float, computed: int) -> tuple[float, float]:
        s = self._samples
        s.append((now, self.generated_tokens, computed))
        while len(s) > 2 and now - s[1][0] >= self.window_s:
            s.popleft()
        t0, g0, c0 = s[0]
        dt = now - t0
        return ((self.generated_tokens - g0) / dt, (computed - c0) / dt) if dt > 0 else (0.0, 0.0)

    def render(self, engine, now: float) -> str:
        st = engine.stats()
        held = engine.scheduler.requests.num_held
        usable = max(st["num_blocks"] - 1, 1)  # block 0 is the null block
        gen_rate, computed_rate = self._rates(now, st["computed_tokens"])
        lb = {"pool": self.pool}
        gauges = (
            ("kvpool_worker_requests_running", "Requests being computed", st["running"]),
            ("kvpool_worker_requests_waiting", "Requests queued for admission", st["waiting"]),
            ("kvpool_worker_kv_blocks_total", "KV blocks of the pool (the null block included)", st["num_blocks"]),
            ("kvpool_worker_kv_blocks_held", "Distinct blocks held by this worker's running requests", held),
            ("kvpool_worker_kv_usage_ratio", "Held blocks / usable blocks", held / usable),
            ("kvpool_worker_generation_tokens_per_second", f"Sampled tokens/s over the last {self.window_s:g}s",
             gen_rate),
            ("kvpool_worker_computed_tokens_per_second", f"Prompt tokens computed/s over the last {self.window_s:g}s",
             computed_rate),
        )
        counters = (
            ("kvpool_worker_generated_tokens_total", "Sampled tokens sent to clients", self.generated_tokens),
            ("kvpool_worker_prompt_tokens_total", "Prompt tokens looked up at admission", st["prompt_tokens"]),
            ("kvpool_worker_cached_tokens_total", "Of those, found in the prefix cache", st["cached_tokens"]),
            ("kvpool_worker_computed_tokens_total", "Prompt tokens computed", st["computed_tokens"]),
            ("kvpool_worker_preemptions_total", "Requests preempted for lack of blocks", st["preemptions"]),
            ("kvpool_worker_steps_total", "Scheduler steps", st["steps"]),
            ("kvpool_worker_registrations_total", "Registrations with the manager", st["registrations"]),
            ("kvpool_worker_manager_resets_total", "Times the manager lost this worker's requests", st["resets"]),
        )
        parts = [family(name, "gauge", help_text, [(lb, v)]) for name, help_text, v in gauges]
        parts += [family(name, "counter", help_text, [(lb, v)]) for name, help_text, v in counters]
        if "node_layout" in st:  # this worker's copies to and from the node tier (worker/node_copier.py)
            parts += node_families(st, lb)
        parts.append(histogram_family("kvpool_worker_step_latency_seconds", "One engine step (schedule, "
                                      "manager round trip, forward, sample)", [(lb, self.step_latency)]))
        return "".join(parts)

    def close(self) -> None:
        self.server.close()


    @classmethod
    def start(cls, cfg) -> WorkerMetrics | None:
        """The endpoint a WorkerConfig asks for (None when metrics_port is 0)."""
        if not cfg.metrics_port:
            return None
        try:
            metrics = cls(cfg.pool, cfg.metrics_host, cfg.metrics_port)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {e}; "
                             "change metrics_port (0: off)") from None
        logger.info("metrics on http://%s:%d/metrics", cfg.metrics_host, metrics.port)
        return metrics


def node_families(st: dict, lb: dict) -> list[str]:
    """The node tier's counters of a worker's ``stats``: blocks copied by level, failed or late
    orders by reason (``deadline``: a disk read or write past node_tier_read_timeout), tokens recomputed."""
    return [
        family("kvpool_worker_node_tier_saves_total", "counter", "Blocks this worker wrote into a node-tier level",
               [({**lb, "level": k}, v) for k, v in sorted(st["node_saves"].items())]),
        family("kvpool_worker_node_tier_loads_total", "counter", "Blocks this worker read from a node-tier level",
               [({**lb, "level": k}, v) for k, v in sorted(st["node_loads"].items())]),
        family("kvpool_worker_node_tier_failures_total", "counter", "Node-tier orders that did not land, by reason",
               [({**lb, "reason": k}, v) for k, v in sorted(st["node_failures"].items())]),
        family("kvpool_worker_node_tier_recomputed_tokens_total", "counter",
               "Tokens computed again because a node-tier load did not land", [(lb, st["node_recomputed_tokens"])]),
        family("kvpool_worker_node_tier_copy_seconds_total", "counter", "Wall time of node-tier copies on the step",
               [(lb, st["node_copy_s"])]),
    ]
