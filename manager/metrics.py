"""The manager's Prometheus metrics: rendered by the loop, served by shared/metrics.py's thread.

The loop calls ``ManagerMetrics.maybe_update(now)`` every iteration; at most every ``interval_s``
it renders the registry and ``ServerStats`` into exposition text and swaps it into the HTTP
server, which only ever serves that string (STYLE rule 6). Per-pool counters restart from 0
when a pool gets a new epoch (a new block space); Prometheus' ``rate()`` handles such resets.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpool.manager.registry import Registry
from kvpool.manager.stats import LATENCY_BOUNDS, LatencyHistogram, ServerStats
from kvpool.shared.metrics import Histogram, MetricsServer, family, histogram_family

POOL_GAUGES = (  # (metric, snapshot_stats key, help)
    ("kvpool_pool_blocks_total", "num_blocks", "KV blocks of the pool (block 0, the null block, included)"),
    ("kvpool_pool_blocks_free", "free_blocks", "Blocks in the free queue (cached ones included)"),
    ("kvpool_pool_blocks_used", "used_blocks", "Blocks held by at least one request"),
    ("kvpool_pool_blocks_cached", "cached_blocks", "Block hashes in the prefix cache"),
    ("kvpool_pool_usage_ratio", "usage", "Used blocks / usable blocks"),
    ("kvpool_pool_prefix_hit_rate", "prefix_hit_rate", "Hit tokens / looked-up prompt tokens, this epoch"),
    ("kvpool_pool_requests", "requests", "Requests holding blocks"),
)
POOL_COUNTERS = (
    ("kvpool_pool_lookup_tokens_total", "lookup_tokens", "Prompt tokens looked up in the prefix cache at allocation"),
    ("kvpool_pool_hit_tokens_total", "hit_tokens", "Of those, tokens found cached"),
    ("kvpool_pool_allocations_total", "allocations", "Successful allocations (request admissions)"),
    ("kvpool_pool_no_space_total", "no_space", "Allocations and extensions refused for lack of free blocks"),
    ("kvpool_pool_evictions_total", "evictions", "Cached block hashes dropped to reuse their blocks"),
    ("kvpool_pool_freed_total", "freed", "Requests freed"),
    ("kvpool_pool_forks_total", "forks", "Request forks (parallel sampling)"),
    ("kvpool_pool_cow_copies_total", "cow_copies", "Copy-on-write block copies ordered"),
)
HOST_GAUGES = (  # pools with a host tier only (manager/core/host_tier.py)
    ("kvpool_pool_host_blocks_total", "host_num_blocks", "Blocks of the pool's host tier (block 0 included)"),
    ("kvpool_pool_host_blocks_free", "host_free_blocks", "Host blocks not pinned by a step (cached ones included)"),
    ("kvpool_pool_host_blocks_cached", "host_cached_blocks", "Block hashes in the host tier"),
)
HOST_COUNTERS = (
    ("kvpool_pool_host_hit_tokens_total", "host_hit_tokens", "Prompt tokens served by loads from the host tier"),
    ("kvpool_pool_host_saves_total", "host_saves", "Device-to-host block saves ordered (demotions)"),
    ("kvpool_pool_host_loads_total", "host_loads", "Host-to-device block loads ordered"),
    ("kvpool_pool_host_writes_total", "host_writes", "Device-to-host block writes ordered (write-through policy)"),
)
NODE_GAUGES = (  # per node-tier layout and level (manager/node_tiers.py)
    ("kvpool_node_tier_blocks_total", "num_blocks", "Slots of the level (slot 0 included)"),
    ("kvpool_node_tier_blocks_cached", "cached_blocks", "Block hashes the level holds"),
    ("kvpool_node_tier_blocks_retained", "retained_blocks", "Of those, kept by retention pins"),
)
NODE_COUNTERS = (
    ("kvpool_node_tier_hits_total", "hits", "Blocks served from the level (to a device, or prefetched up)"),
    ("kvpool_node_tier_saves_total", "saves", "Blocks written into the level"),
    ("kvpool_node_tier_saves_skipped_total", "saves_skipped", "Saves of a hash the level held already"),
    ("kvpool_node_tier_saves_dropped_total", "saves_dropped", "Saves with every slot referenced (not kept)"),
    ("kvpool_node_tier_save_failures_total", "save_failures", "Saves the worker reported failed (full disk, I/O)"),
    ("kvpool_node_tier_loads_total", "loads", "Orders reading the level"),
    ("kvpool_node_tier_verify_failures_total", "verify_failures", "Loads that did not verify (recomputed, never served)"),
    ("kvpool_node_tier_deadline_misses_total", "deadline_misses", "Disk reads and writes past the worker's deadline"),
)
MANAGER_COUNTERS = (
    ("kvpool_messages_total", "messages", "Request payloads received (bad ones included)"),
    ("kvpool_replies_total", "replies", "Replies handed to the socket"),
    ("kvpool_dropped_total", "dropped", "Messages with a malformed envelope (no reply possible)"),
    ("kvpool_replies_dropped_total", "replies_dropped", "Replies the socket refused (client gone or not reading)"),
    ("kvpool_loop_iterations_total", "iterations", "Manager loop iterations"),
    ("kvpool_sessions_expired_total", "sessions_expired", "Sessions ended for silence"),
    ("kvpool_expired_requests_freed_total", "expired_requests_freed", "Requests freed with expired sessions"),
    ("kvpool_sub_ops_total", "sub_ops", "Step sub-ops executed"),
    ("kvpool_event_batches_total", "event_batches", "KV-event batches published"),
    ("kvpool_events_total", "events", "KV events published"),
)
EXTERNAL_COUNTERS = (  # attached vLLM servers' mirrors (manager/external/mirror.py)
    ("kvpool_external_event_batches_total", "applied", "KV-event batches applied to the mirror"),
    ("kvpool_external_stored_blocks_total", "stored", "Blocks indexed from BlockStored"),
    ("kvpool_external_removed_blocks_total", "removed", "Blocks dropped by BlockRemoved"),
    ("kvpool_external_gaps_total", "gaps", "Sequence gaps seen in the event stream"),
    ("kvpool_external_replays_total", "replays", "Replays asked of the server"),
    ("kvpool_external_lost_batches_total", "lost", "Batches neither published nor replayed"),
    ("kvpool_external_restarts_total", "restarts", "Publisher restarts seen (its sequence went back)"),
    ("kvpool_external_orphan_blocks_total", "orphans", "Stored blocks not indexable (parent unknown, unhashed keys)"),
    ("kvpool_external_silences_total", "silenced", "Times its events stopped while it computed blocks"),
    ("kvpool_external_rebuilds_total", "rebuilds", "Rebuilds of the mirror from a clean state (after a silence)"),
)
EXTERNAL_LOAD = (  # the attached servers' own /metrics, as last polled (manager/external/probe.py)
    ("kvpool_external_running", "running", "Requests the server runs (its vllm:num_requests_running)"),
    ("kvpool_external_waiting", "waiting", "Requests waiting at the server (its vllm:num_requests_waiting)"),
    ("kvpool_external_kv_usage", "kv_usage", "Its vllm:kv_cache_usage_perc (0..1)"),
)
HISTOGRAMS = (
    ("kvpool_step_latency_seconds", "step_latency", "Time to execute one step message's sub-ops"),
    ("kvpool_iteration_latency_seconds", "iteration_latency", "Busy loop iterations, receive to last reply"),
    ("kvpool_store_commit_latency_seconds", "commit_latency", "State store commit per iteration with changes"),
)


def _histogram(h: LatencyHistogram) -> Histogram:
    return Histogram.of(LATENCY_BOUNDS, h.counts, h.sum, h.total)


def render(reg: Registry, stats: ServerStats, uptime_s: float, externals: list[dict] | None = None) -> str:
    """The exposition text of the manager's state now (called on the loop's thread);
    ``externals``: the attached servers' rows (the ``externals`` op's)."""
    parts = [
        family("kvpool_manager_info", "gauge", "Constant 1; the labels identify the manager process",
               [({"incarnation": reg.incarnation}, 1)]),
        family("kvpool_uptime_seconds", "gauge", "Seconds since the manager started", [({}, uptime_s)]),
        family("kvpool_sessions", "gauge", "Open client sessions", [({}, len(reg.sessions))]),
        family("kvpool_pools", "gauge", "Pools known (ready or pending)", [({}, len(reg.pools))]),
        family("kvpool_draining", "gauge", "1 while new allocations are refused (kvpool drain)",
               [({}, int(reg.draining))]),
    ]
    pools = {name: (e, e.pool.snapshot_stats() if e.pool is not None else None) for name, e in reg.pools.items()}
    parts.append(family("kvpool_pool_ready", "gauge", "1 when every shard registered, 0 while pending",
                        [({"pool": n}, int(s is not None)) for n, (_, s) in pools.items()]))
    parts.append(family("kvpool_pool_epoch", "gauge", "The pool's epoch (moves on when a shard restarts)",
                        [({"pool": n}, e.epoch) for n, (e, _) in pools.items()]))
    ready = [(n, s) for n, (_, s) in pools.items() if s is not None]
    for kind, table in (("gauge", POOL_GAUGES), ("counter", POOL_COUNTERS)):
        for metric, key, help_text in table:
            parts.append(family(metric, kind, help_text, [({"pool": n}, s[key]) for n, s in ready]))
    tiered = [(n, s) for n, s in ready if "host_num_blocks" in s]
    for kind, table in (("gauge", HOST_GAUGES), ("counter", HOST_COUNTERS)):
        for metric, key, help_text in table if tiered else ():
            parts.append(family(metric, kind, help_text, [({"pool": n}, s[key]) for n, s in tiered]))
    parts += node_families(reg, ready)
    for metric, attr, help_text in MANAGER_COUNTERS:
        parts.append(family(metric, "counter", help_text, [({}, getattr(stats, attr))]))
    parts.append(family("kvpool_ops_total", "counter", "Valid requests by op",
                        [({"op": op}, n) for op, n in sorted(stats.ops.items())]))
    parts.append(family("kvpool_errors_total", "counter", "Error replies by code",
                        [({"code": code}, n) for code, n in sorted(stats.errors.items())]))
    for metric, attr, help_text in HISTOGRAMS:
        parts.append(histogram_family(metric, help_text, [({}, _histogram(getattr(stats, attr)))]))
    if externals:
        parts.append(family("kvpool_external_stale", "gauge", "1 while the mirror is not exact (no prefix claims)",
                            [({"pool": r["name"]}, int(r["stale"] is not None)) for r in externals]))
        parts.append(family("kvpool_external_blocks", "gauge", "Blocks the mirror holds, per medium",
                            [({"pool": r["name"], "medium": m}, n) for r in externals
                             for m, n in sorted(r["blocks"].items())]))
        for metric, key, help_text in EXTERNAL_COUNTERS:
            parts.append(family(metric, "counter", help_text,
                                [({"pool": r["name"]}, r.get(key, 0)) for r in externals]))
        parts.append(family("kvpool_external_http_up", "gauge", "1 when its /metrics answered the last poll",
                            [({"pool": r["name"]}, int(r.get("http", "") is None)) for r in externals]))
        for metric, key, help_text in EXTERNAL_LOAD:
            parts.append(family(metric, "gauge", help_text,
                                [({"pool": r["name"]}, r[key]) for r in externals if key in r]))
    return "".join(parts)


def node_families(reg: Registry, ready: list[tuple[str, dict]]) -> list[str]:
    """The node tiers' metrics, by layout and level, and each pool's tokens served from them."""
    if reg.node is None:
        return []
    usage = reg.node.usage()
    rows = [(layout, name, u[name]) for layout, u in usage.items() for name in ("host", "disk") if name in u]
    parts = [family("kvpool_node_tier_batches", "gauge", "Batches of copy orders given out and not yet reported",
                    [({"layout": layout}, u["batches"]) for layout, u in usage.items()])]
    for kind, table in (("gauge", NODE_GAUGES), ("counter", NODE_COUNTERS)):
        for metric, key, help_text in table:
            parts.append(family(metric, kind, help_text, [({"layout": la, "level": lv}, s[key]) for la, lv, s in rows]))
    parts.append(family("kvpool_node_tier_removed_total", "counter", "Hashes that left the level, by why",
                        [({"layout": la, "level": lv, "reason": r}, n) for la, lv, s in rows
                         for r, n in sorted(s["removed"].items())]))
    tiered = [(n, s) for n, s in ready if "node_hit_tokens" in s]
    parts.append(family("kvpool_pool_node_hit_tokens_total", "counter", "Prompt tokens a pool took from the node tier",
                        [({"pool": n, "level": lv}, s[f"node_{lv}_hit_tokens"]) for n, s in tiered
                         for lv in ("host", "disk")]))
    return parts


class ManagerMetrics:
    """The loop's side of the metrics endpoint: renders at most every ``interval_s``."""

    def __init__(self, reg: Registry, stats: ServerStats, host: str, port: int, interval_s: float = 0.5,
                 externals: Callable[[], list[dict]] = list) -> None:
        self.reg, self.stats, self.interval_s = reg, stats, interval_s
        self.externals = externals
        self.server = MetricsServer(host, port)
        self.port = self.server.port
        self.started = time.monotonic()
        self._next = 0.0

    def maybe_update(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.interval_s
        self.server.update(render(self.reg, self.stats, now - self.started, self.externals()))
        return True

    def close(self) -> None:
        self.server.close()
