"""Whether a live worker session backs every shard of a pool (the `pools` and `stats` ops).

A shard's ``sid`` says how its worker left (manager/registry.py): still a live session, None
after a clean ``deregister``, or a session that expired (the process died without saying so).

    ok       the pool is formed and every shard's session is live
    waiting  some shards registered and live, the others not yet (or not again)
    idle     no shard has a live session and every one left cleanly: nothing is wrong
    lost     a shard's session expired: its worker died; restart it or `kvpool drop-pool`

Only ``ok`` and ``idle`` are healthy; ``kvpool status --pool NAME`` wants ``ok``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.manager.registry import PoolEntry, Session

HEALTHY = ("ok", "idle")


@dataclass(frozen=True)
class PoolHealth:
    health: str  # ok | waiting | idle | lost
    live_shards: int  # shards whose registering session is live
    dead_shards: list[int]  # ranks whose session expired

    def as_dict(self) -> dict:
        return {"health": self.health, "live_shards": self.live_shards, "dead_shards": self.dead_shards}


def pool_health(entry: PoolEntry, sessions: dict[str, Session]) -> PoolHealth:
    shards = entry.shards.values()
    live = sum(1 for s in shards if s.sid is not None and s.sid in sessions)
    dead = sorted(s.rank for s in shards if s.sid is not None and s.sid not in sessions)
    if dead:
        health = "lost"
    elif entry.pool is not None and live == entry.shard_count:
        health = "ok"
    elif live == 0:
        health = "idle"
    else:
        health = "waiting"
    return PoolHealth(health, live, dead)
