"""The admin ops (PROTOCOL.md section 6): ``pools``, ``sessions``, ``requests``, ``reset_cache``,
``evict``, ``drain``, ``drop_pool``, ``shutdown``, ``check``, ``cached_hashes``. A mixin of
``Handlers`` (manager/handlers.py), registered with ``@op(admin=True)`` as the rest; with the
argument checks and the pool summary both halves use.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool import NODE_LEVELS, Pool
from kvpool.manager.health import pool_health
from kvpool.manager.ops import Call, op
from kvpool.manager.state.entries import PoolEntry
from kvpool.manager.stats import ServerStats
from kvpool.shared.protocol import MAX_HASHES, POOL_NAME, ManagerError, bad_field, get_int, get_str
from kvpool.shared.summaries import PoolSummary

if TYPE_CHECKING:
    from kvpool.manager.registry import Registry

U63 = (1 << 63) - 1


def check_tier(args: dict, pool: Pool, node: bool = False) -> str:
    """``args.tier``: "device" (the default) or "host", which the pool must have; with ``node``
    also "node_host" or "node_disk", a level of the pool's node tier."""
    tier = args.get("tier", "device")
    tiers = ("device", "host", *NODE_LEVELS) if node else ("device", "host")
    if tier not in tiers:
        raise bad_field("tier", " or ".join(f'"{t}"' for t in tiers), tier)
    if tier == "host" and pool.host is None:
        raise bad_field("tier", '"device": the pool has no host tier (no worker offered --host-kv-memory)', tier)
    if tier in NODE_LEVELS and (pool.node is None or NODE_LEVELS[tier] not in pool.node.tier.levels):
        raise bad_field("tier", f'a level the pool has: it has no {tier.replace("_", " ")} level', tier)
    return tier


def pool_summary(entry: PoolEntry, sessions: Container[str]) -> PoolSummary:
    """``registered`` counts the shards with a live session (one that left may stay for its spec)."""
    pool = entry.pool
    host = pool.host if pool is not None else None
    return PoolSummary(entry.name, entry.state, entry.epoch, entry.live_shards(sessions), entry.shard_count,
                       pool.blocks.num_blocks if pool else 0, entry.spec.block_size,
                       host.num_blocks if host is not None else None, host.policy if host is not None else None)


def node_summary(layout: str | None, tier: NodeTier) -> dict:
    """The node tier a pool shares (``pools``): its layout, and per level cached / slots."""
    return {"node_layout": layout, **{f"node_{name}": [len(lv.blocks.cached), lv.num_blocks - 1]
                                      for name, lv in tier.levels.items()}}


def flag(args: dict, key: str) -> bool:
    value = args.get(key, False)
    if type(value) is not bool:
        raise bad_field(key, "a bool", value)
    return value


class AdminOps:
    reg: Registry
    counters: ServerStats
    request_stop: Callable[[], None]
    external_rows: Callable[[], list[dict]]  # (ExternalOps, beside it in Handlers)

    @op(admin=True)
    def pools(self, call: Call) -> dict:
        out = []
        live = self.reg.sessions
        for entry in self.reg.pools.values():
            info = pool_summary(entry, self.reg.sessions).to_wire()
            pool = entry.pool
            info.update(pool_health(entry, live).as_dict())
            info.update(
                spec=entry.common_spec(),
                free_blocks=pool.blocks.num_free if pool else 0,
                cached_blocks=len(pool.blocks.cached) if pool else 0,
                requests=len(pool.requests) if pool else 0,
                **({"host_cached_blocks": len(pool.host.blocks.cached)} if pool and pool.host else {}),
                **(node_summary(entry.node_layout, pool.node.tier) if pool and pool.node else {}),
                shards=[{"rank": s.rank, "incarnation": s.incarnation, "num_blocks": s.num_blocks,
                         "num_kv_heads": s.spec.num_kv_heads, "session": live[s.sid].num if s.sid in live else None,
                         **({"host_num_blocks": s.host_num_blocks} if s.host_kv_bytes else {})}
                        for s in sorted(entry.shards.values(), key=lambda s: s.rank)],
            )
            out.append(info)
        externals = self.external_rows()  # attached vLLM servers: their mirrors' health and load
        return {"pools": out, **({"externals": externals} if externals else {})}

    @op(admin=True)
    def sessions(self, call: Call) -> dict:
        now = call.now
        counts = self.reg.request_counts()
        rows = [{"session": s.num, "identity": s.identity, "role": s.role, "admin": s.admin,
                 "age_s": now - s.created, "idle_s": now - s.last_seen, "requests": counts.get(s.sid, 0)}
                for s in self.reg.sessions.values()]
        return {"sessions": rows}

    @op(admin=True)
    def requests(self, call: Call) -> dict:
        args = call.args
        entry, pool = self.reg.ready_pool(args.get("pool"))
        limit = get_int(args, "limit", 1, 1 << 20, default=10_000)
        with_ids = args.get("block_ids", False)
        if type(with_ids) is not bool:
            raise bad_field("block_ids", "a bool", with_ids)
        live = self.reg.sessions
        rows = []
        for (sid, rid), req in pool.requests.items():  # type: ignore[misc]
            if len(rows) >= limit:
                break
            owner = live.get(sid)
            rows.append({"session": owner.num if owner else None, "identity": owner.identity if owner else None,
                         "req": rid, "num_tokens": req.num_tokens, "blocks": len(req.blocks),
                         "cached_blocks": req.num_cached})
            if with_ids:
                rows[-1]["block_ids"] = list(req.blocks)
        return {"pool": entry.name, "epoch": entry.epoch, "total": len(pool.requests), "requests": rows}

    @op(admin=True)
    def reset_cache(self, call: Call) -> dict:
        args = call.args
        entry, pool = self.reg.ready_pool(args.get("pool"))
        tier = check_tier(args, pool, node=True)
        if not self.reg.reset_cache(entry, tier):
            if tier != "device":
                raise ManagerError("in_use", f"pool {entry.name!r}: {tier} blocks are pinned by a step; retry")
            raise ManagerError("in_use", f"pool {entry.name!r} has {pool.blocks.num_used} blocks in use; "
                               "drain it first (kvpool drain), then reset")
        return {"reset": True}

    @op(admin=True)
    def evict(self, call: Call) -> dict:
        args = call.args
        entry, pool = self.reg.ready_pool(args.get("pool"))
        n = get_int(args, "n", 0, U63)
        return {"evicted": self.reg.evict(entry, n, check_tier(args, pool, node=True))}

    @op(admin=True)
    def drain(self, call: Call) -> dict:
        args = call.args
        enable = args.get("enable", True)
        if type(enable) is not bool:
            raise bad_field("enable", "a bool", enable)
        self.reg.set_draining(enable)
        return {"draining": enable, "requests": self.reg.total_requests()}

    @op(admin=True)
    def drop_pool(self, call: Call) -> dict:
        args = call.args
        entry = self.reg.get_pool(get_str(args, "pool", 64, pattern=POOL_NAME))
        force = flag(args, "force")
        health = pool_health(entry, self.reg.sessions)
        if health.live_shards and not force:
            raise ManagerError("in_use", f"pool {entry.name!r}: {health.live_shards} shard(s) are held by live "
                               "worker sessions; stop those workers first, or drop it anyway with force")
        return {"pool": entry.name, "dropped": True, "freed": self.reg.drop_pool(entry)}

    @op(admin=True)
    def shutdown(self, call: Call) -> dict:
        self.request_stop()
        return {"stopping": True}

    @op(admin=True)
    def check(self, call: Call) -> dict:
        try:
            self.reg.check_invariants()
        except InvariantBroken as e:
            raise ManagerError("invariant_broken", str(e)) from e
        return {"pools": len(self.reg.pools), "sessions": len(self.reg.sessions),
                "requests": self.reg.total_requests()}

    @op(admin=True)
    def cached_hashes(self, call: Call) -> dict:
        """One tier's prefix-cache keys (what a KV-event subscriber holds for that tier's
        ``medium``), sorted; the device tier unless ``tier`` says "host"."""
        args = call.args
        entry, pool = self.reg.ready_pool(args.get("pool"))
        limit = get_int(args, "limit", 1, MAX_HASHES, default=MAX_HASHES)
        tier = check_tier(args, pool)
        cached = pool.host.blocks.cached if tier == "host" else pool.blocks.cached  # type: ignore[union-attr]
        return {"pool": entry.name, "epoch": entry.epoch, "tier": tier, "total": len(cached),
                "hashes": sorted(cached)[:limit], "event_batches": self.counters.event_batches}
