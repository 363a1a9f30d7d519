"""The registry's records: a session (one connected client), a shard, a pool entry.

``Registry`` (manager/registry.py) owns every one of them and is the only thing that changes them,
through the small methods here (a store builds them when it loads a state); manager/registry.py's
docstring says what each means over its life.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.pool import PIN_OWNER, Pool
from kvpool.shared.protocol import KVSpec

GLOBAL = "\x00global"  # dirty marker: sessions or manager-wide flags (not a valid pool name)
COMMON_SPEC = ("block_size", "num_layers", "head_size", "dtype")  # shards agree on these


@dataclass
class Session:
    sid: str
    num: int
    identity: str
    role: str
    admin: bool
    version: int
    created: float
    last_seen: float
    # The last step's message id and results: a client retrying a step after a timeout or a
    # failover (same id) gets these instead of running it twice (PROTOCOL.md section 10).
    last_step_id: int | None = None
    last_step: list | None = None

    def seen(self, now: float) -> None:
        """A message of this session arrived (expiry counts from here)."""
        self.last_seen = now

    def remember_step(self, msg_id: int, results: list) -> None:
        self.last_step_id, self.last_step = msg_id, results


@dataclass
class Shard:
    rank: int
    incarnation: str
    spec: KVSpec
    available_kv_bytes: int
    num_blocks: int
    # The session that registered it. None once that session ended with deregister; an expired
    # session's sid stays (no longer in Registry.sessions): the shard's process died.
    sid: str | None
    serve: dict | None = None  # where this shard takes generate requests (register's optional field)
    host_kv_bytes: int = 0  # host memory offered for the host tier (0: none)
    host_kv_policy: str = "demote"  # or "write_through" (manager/core/host_tier.py)
    node_layout: str | None = None  # the node tier (layout id, hex) the shard's pool uses (None: none)

    @property
    def host_num_blocks(self) -> int:
        return self.host_kv_bytes // self.spec.block_bytes

    def rebind(self, sid: str, serve: dict | None) -> None:
        """The same incarnation registered again (a new session of the same process)."""
        self.sid, self.serve = sid, serve

    def session_ended(self, cause: str) -> None:
        """Its session ended: a clean ``deregister`` unbinds it; an expiry keeps the dead sid."""
        if cause == "deregister":
            self.sid = None


@dataclass
class PoolEntry:
    name: str
    shard_count: int
    shards: dict[int, Shard] = field(default_factory=dict)
    epoch: int = 0  # 0 until every shard has registered
    pool: Pool | None = None

    @property
    def spec(self) -> KVSpec:
        """A shard's spec: its COMMON_SPEC fields are what every shard of the pool agrees on (a
        shard's ``num_kv_heads`` is its own slice of the heads)."""
        return next(iter(self.shards.values())).spec

    def common_spec(self) -> dict:
        """What every shard of the pool agrees on (COMMON_SPEC), as a wire map."""
        spec = self.spec
        return {k: getattr(spec, k) for k in COMMON_SPEC}

    @property
    def state(self) -> str:
        return "ready" if self.pool is not None else "pending"

    def live_shards(self, sessions: Container[str]) -> int:
        """Registered shards whose session is alive (one that left may stay, unbound, for its spec)."""
        return sum(s.sid is not None and s.sid in sessions for s in self.shards.values())

    def form(self, pool: Pool) -> None:
        """Every shard registered: the entry serves ``pool`` in the next epoch."""
        self.epoch += 1
        self.pool = pool

    def lose_pool(self, next_epoch: bool = False) -> None:
        """The Pool is gone (a shard left, a replacement, a drop); ``next_epoch``: older epochs
        are stale from now on."""
        self.pool = None
        if next_epoch:
            self.epoch += 1

    @property
    def host_num_blocks(self) -> int:
        """Blocks of the pool's host tier: the fewest any shard's host memory holds (0: no tier)."""
        return min((s.host_num_blocks for s in self.shards.values()), default=0)

    @property
    def node_layout(self) -> str | None:
        """The node tier of a pool whose every shard mapped its stores of that tier's layout
        (None when one did not: a tensor-parallel pool's ranks copy together or not at all)."""
        layouts = {s.node_layout for s in self.shards.values()}
        return layouts.pop() if len(self.shards) == self.shard_count and len(layouts) == 1 else None

    @property
    def host_policy(self) -> str:
        """Write-through only when every shard asks for it (each one runs the copies); else demote."""
        policies = {s.host_kv_policy for s in self.shards.values()}
        return "write_through" if policies == {"write_through"} else "demote"


def check_pools(pools: Iterable[PoolEntry], sessions: Container[str]) -> None:
    """Every pool's invariants, no request without a live session, and no ready pool of
    several shards with a shard whose session is gone (its KV slice is gone with it).
    Raises InvariantBroken (explicit checks, not asserts: they hold under ``python -O``)."""
    for entry in pools:
        if entry.pool is None:
            continue
        entry.pool.check_invariants()
        for key in entry.pool.requests:
            if key[0] not in sessions and key[0] != PIN_OWNER:  # type: ignore[index]
                raise InvariantBroken(f"pool {entry.name}: request {key[1]!r:.60} of a dead session")  # type: ignore[index]
        if len(entry.shards) != entry.shard_count:
            raise InvariantBroken(f"pool {entry.name}: ready without all shards")
        dead = [s.rank for s in entry.shards.values() if s.sid not in sessions]
        if entry.shard_count > 1 and dead:
            raise InvariantBroken(f"pool {entry.name}: ready with shards {dead} whose sessions are gone")
