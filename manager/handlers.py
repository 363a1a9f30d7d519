"""One function per manager op: validate ``args``, act on the registry, return the reply body.

Handlers raise ``ManagerError(code, message)`` for bad input; the server turns it into an error
reply. Each takes a ``Call`` (manager/ops.py: message id, session, args, clock); its session
is None only for hello. ``@op`` registers each one in the dispatch table (``OPS``) with whether
it needs a session and whether it is an admin op.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Container

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.pool import NODE_LEVELS, Pool
from kvpool.manager.core.retention import MAX_TTL_S
from kvpool.manager.external.ops import ExternalOps
from kvpool.manager.guards import Bounds, check_owner, check_register, check_step, max_model_len
from kvpool.manager.health import pool_health
from kvpool.manager.ops import Call, op
from kvpool.manager.registry import PoolEntry, Registry
from kvpool.manager.state.entries import Session
from kvpool.manager.stats import ServerStats
from kvpool.shared.node_orders import reports_from_wire
from kvpool.shared.node_tier import MAX_MODEL_ID
from kvpool.shared.protocol import (
    HOST_POLICIES,
    MAX_HASHES,
    POOL_NAME,
    PROTOCOL_VERSION,
    ROLES,
    SUPPORTED_VERSIONS,
    KVSpec,
    ManagerError,
    bad_field,
    get_hashes,
    get_int,
    get_map,
    get_str,
    short_repr,
)
from kvpool.shared.step_ops import decode_ops
from kvpool.shared.summaries import PoolSummary, ServeInfo, WorkerRow

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


def _flag(args: dict, key: str) -> bool:
    value = args.get(key, False)
    if type(value) is not bool:
        raise bad_field(key, "a bool", value)
    return value


class Handlers(ExternalOps):
    def __init__(
        self,
        registry: Registry,
        stats: ServerStats,
        *,
        max_sub_ops: int,
        max_message_bytes: int,
        admin_key: str | None,
        request_stop: Callable[[], None],
        bounds: Bounds | None = None,
        store_stats: Callable[[], dict] = dict,
        events_info: dict | None = None,
        admin_needs_key: bool = False,
    ) -> None:
        self.reg, self.counters = registry, stats
        self.max_sub_ops, self.max_message_bytes = max_sub_ops, max_message_bytes
        self.admin_key = admin_key
        self.request_stop = request_stop
        self.bounds = bounds or Bounds()
        self.started = time.monotonic()
        self.store_stats = store_stats  # the state store's counters
        # where KV events are published (None: off): `kvpool events` asks
        self.events_info = events_info or {"events_endpoint": None, "events_replay_endpoint": None}
        # With CURVE on, an allowed worker key is no admin credential: admin ops then need admin_key.
        self.admin_needs_key = admin_needs_key

    # -- sessions --------------------------------------------------------------------------

    @op(session=False)
    def hello(self, call: Call) -> dict:
        args, now = call.args, call.now
        identity = get_str(args, "identity", 128, default="anonymous")
        role = args.get("role", "worker")
        if role not in ROLES:
            raise bad_field("role", f"one of {list(ROLES)}", role)
        versions = args.get("versions", [PROTOCOL_VERSION])
        if type(versions) is not list or not 0 < len(versions) <= 16:
            raise bad_field("versions", "a list of 1-16 ints", versions)
        common = [v for v in SUPPORTED_VERSIONS if v in versions]
        if not common:
            raise ManagerError("unsupported_version", f"manager speaks versions {list(SUPPORTED_VERSIONS)}, "
                               f"client {short_repr(versions)}", {"versions": list(SUPPORTED_VERSIONS)})
        sess = self.reg.open_session(identity, role, self._admin_ok(role, args.get("admin_key")), max(common), now)
        timeout = float(self.reg.session_timeout_s)
        return {
            "sid": sess.sid,
            "session": sess.num,
            "incarnation": self.reg.incarnation,
            "state_id": self.reg.state_id,
            "durable": self.reg.durable,
            "version": sess.version,
            "admin": sess.admin,
            "session_timeout_s": timeout,
            "heartbeat_interval_s": timeout / 3,
            "limits": {"max_message_bytes": self.max_message_bytes, "max_sub_ops": self.max_sub_ops,
                       "max_hashes": MAX_HASHES, "max_step_blocks": self.bounds.max_step_blocks,
                       "max_model_len": self.bounds.max_model_len,
                       "max_session_blocks": self.bounds.max_session_blocks},
        }

    def _admin_ok(self, role: str, key: object) -> bool:
        if self.admin_key is None:
            return not self.admin_needs_key  # no key configured: every client may, unless CURVE is on
        if role != "admin":
            return False
        if type(key) is not str or not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise ManagerError("forbidden", "role 'admin' needs the manager's admin key (admin_key)")
        return True

    @op()
    def heartbeat(self, call: Call) -> dict:
        return {}

    @op()
    def deregister(self, call: Call) -> dict:
        sess = call.sess
        return {"freed": self.reg.end_session(sess.sid)}

    # -- pools -----------------------------------------------------------------------------

    @op()
    def register(self, call: Call) -> dict:
        args, sess = call.args, call.sess
        name = get_str(args, "pool", 64, pattern=POOL_NAME)
        rank, count = get_int(args, "shard_rank", 0, 4095), get_int(args, "shard_count", 1, 4096)
        incarnation = get_str(args, "incarnation", 128)
        spec = KVSpec.from_wire(get_map(args, "spec"))
        if spec.max_model_len is not None and spec.max_model_len > self.bounds.max_model_len:
            raise bad_field("max_model_len", f"an int in [1, {self.bounds.max_model_len}]", spec.max_model_len)
        available = get_int(args, "available_kv_bytes", 0, U63)
        host_kv_bytes = get_int(args, "host_kv_bytes", 0, U63) if "host_kv_bytes" in args else 0
        host_kv_policy = args.get("host_kv_policy", "demote")
        if host_kv_policy not in HOST_POLICIES:
            raise bad_field("host_kv_policy", " or ".join(f'"{p}"' for p in HOST_POLICIES), host_kv_policy)
        replace = args.get("replace", False)
        if type(replace) is not bool:
            raise bad_field("replace", "a bool", replace)
        node_model = get_str(args, "node_model", MAX_MODEL_ID) if "node_model" in args else None
        # where rank 0 takes generate requests: validated, kept (and journaled) as its wire map
        serve = ServeInfo.from_wire(args["serve"]).to_wire() if "serve" in args else None
        check_register(self.reg, self.bounds, sess, name, rank, incarnation, available // spec.block_bytes, replace)
        entry = self.reg.register(sess, name, rank, count, incarnation, spec, available, serve, host_kv_bytes,
                                  host_kv_policy, node_model)
        out = {**pool_summary(entry, self.reg.sessions).to_wire(), "max_model_len": max_model_len(self.bounds, entry)}
        node = self.reg.node_info(entry) if node_model is not None else None
        if node is not None:
            out["node_tier"] = node.to_wire()
        return out

    @op()
    def step(self, call: Call) -> dict:
        args, sess = call.args, call.sess
        entry, pool = self.reg.ready_pool(args.get("pool"), get_int(args, "epoch", 1, U63))
        check_owner(self.reg, sess, entry)
        ops = args.get("ops")
        if type(ops) is not list:
            raise bad_field("ops", "a list of sub-op maps", ops)
        if len(ops) > self.max_sub_ops:
            raise ManagerError("too_many_sub_ops", f"{len(ops)} sub-ops; at most {self.max_sub_ops} per step")
        last = sess.last_step_id
        if self.reg.durable and last is not None and call.msg_id <= last:  # ids increase (PROTOCOL.md 11)
            if call.msg_id == last:  # a retry (timeout, failover): the step ran once, answer again
                return {"results": sess.last_step}
            raise ManagerError("stale_request", f"step id {call.msg_id} is older than this session's last "
                               f"step {last}: a late duplicate, not run")
        if "node_done" in args:  # before the sub-ops: what those batches held is free for them
            self._node_done(sess, entry, args["node_done"])
        decoded = decode_ops(ops)
        check_step(self.bounds, entry, sess.sid, decoded)
        t0 = time.perf_counter()
        results = self.reg.step(sess, entry, ops, call.msg_id, decoded)
        self.counters.step_latency.observe(time.perf_counter() - t0)
        self.counters.sub_ops += len(ops)
        return {"results": results}

    @op()
    def node_done(self, call: Call) -> dict:
        """Node-tier batches a worker ran, when no step message carries them."""
        args, sess = call.args, call.sess
        epoch = get_int(args, "epoch", 1, U63) if "epoch" in args else None
        entry, _ = self.reg.ready_pool(args.get("pool"), epoch)
        check_owner(self.reg, sess, entry)
        return {"finished": self._node_done(sess, entry, args.get("reports"))}

    def _node_done(self, sess: Session, entry: PoolEntry, reports: object) -> int:
        """Validates every report against its batch first (nothing changes on bad input), then
        finishes each known batch; returns how many."""
        batches = entry.pool.node.tier.batches if entry.pool is not None and entry.pool.node is not None else {}
        checked = []
        for r in reports_from_wire(reports):
            batch = batches.get((sess.sid, r.batch))
            if batch is None:
                continue  # abandoned (a re-formed pool, a manager restart): nothing to finish
            for order in r.failed:
                if order not in batch.orders:
                    raise bad_field("node_done.failed", f"orders of batch {r.batch}", order.to_wire())
            checked.append(r)
        for r in checked:
            self.reg.node_finish(sess, entry, r.batch, [o.to_wire() for o in r.failed])
        return len(checked)

    @op()
    def lookup(self, call: Call) -> dict:
        args = call.args
        epoch = get_int(args, "epoch", 1, U63) if "epoch" in args else None
        _, pool = self.reg.ready_pool(args.get("pool"), epoch)
        return {"blocks": pool.lookup(get_hashes(args))}

    @op()
    def workers(self, call: Call) -> dict:
        """Ready pools whose rank-0 shard announced a generate endpoint and is still connected:
        what a front door routes to."""
        out = []
        for entry in self.reg.pools.values():
            lead = entry.shards.get(0)
            if entry.pool is None or lead is None or lead.serve is None or lead.sid not in self.reg.sessions:
                continue
            blocks = entry.pool.blocks
            serve = ServeInfo(lead.serve["endpoint"], lead.serve["model"], lead.serve["max_model_len"],
                              lead.serve.get("tokenizer"))
            out.append(WorkerRow(serve, entry.name, entry.epoch, blocks.num_blocks, entry.spec.block_size,
                                 blocks.num_free, len(entry.pool.requests)).to_wire())
        return {"workers": out, "draining": self.reg.draining}

    @op()
    def locate(self, call: Call) -> dict:
        args = call.args
        hashes = get_hashes(args)
        out = {"pools": {name: e.pool.lookup(hashes) for name, e in self.reg.pools.items() if e.pool is not None}}
        if self.external is not None:  # attached vLLM servers whose index is exact (not stale)
            out["external"] = self.external_hits(hashes)
        return out

    @op()
    def stats(self, call: Call) -> dict:
        args, sess = call.args, call.sess
        reg = self.reg
        manager = {
            "incarnation": reg.incarnation,
            "state_id": reg.state_id,
            "durable": reg.durable,
            "version": PROTOCOL_VERSION,
            "uptime_s": time.monotonic() - self.started,
            "sessions": len(reg.sessions),
            "pools": len(reg.pools),
            "requests": reg.total_requests(),
            "draining": reg.draining,
            **self.events_info,
            **self.counters.snapshot(),
        }
        if reg.node is not None:
            manager["node_tiers"] = reg.node.usage()
        pools = {}
        for name, entry in reg.pools.items():
            snap = entry.pool.snapshot_stats() if entry.pool is not None else {}
            pools[name] = {**snap, "state": entry.state, "epoch": entry.epoch, "shard_count": entry.shard_count,
                           **pool_health(entry, reg.sessions).as_dict()}
        if _flag(args, "message_rows"):  # every recent message's timings, for a benchmark to join
            if not sess.admin:
                raise ManagerError("forbidden", "stats with message_rows is for admin sessions: hello with role "
                                   "'admin' (and the admin key, when the manager has one)")
            manager["message_rows"] = self.counters.message_times.columns()
        return {"manager": manager, "pools": pools, "store": self.store_stats()}

    # -- admin -----------------------------------------------------------------------------

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
                shards=[{"rank": s.rank, "incarnation": s.incarnation, "num_blocks": s.num_blocks,
                         "num_kv_heads": s.spec.num_kv_heads, "session": live[s.sid].num if s.sid in live else None,
                         **({"host_num_blocks": s.host_num_blocks} if s.host_kv_bytes else {})}
                        for s in sorted(entry.shards.values(), key=lambda s: s.rank)],
            )
            out.append(info)
        return {"pools": out}

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
    def pin(self, call: Call) -> dict:
        """Keeps a prefix's blocks from eviction for ``ttl_s`` seconds (manager/pins.py)."""
        args = call.args
        entry, _ = self.reg.ready_pool(args.get("pool"))
        hashes = get_hashes(args)
        if not hashes:
            raise bad_field("hashes", "at least one block hash", hashes)
        ttl = args.get("ttl_s")
        if type(ttl) not in (int, float) or not 0 < ttl <= MAX_TTL_S:
            raise bad_field("ttl_s", f"seconds in (0, {MAX_TTL_S:.0f}]", ttl)
        pin = self.reg.pin(entry, hashes, float(ttl), time.time())
        return pin.row(time.time())

    @op(admin=True)
    def unpin(self, call: Call) -> dict:
        pin_id = get_int(call.args, "pin_id", 1, U63)
        if pin_id not in self.reg.pins.pins:
            raise bad_field("pin_id", f"a pin's id (pins: {sorted(self.reg.pins.pins)[:20]})", pin_id)
        return {"unpinned": self.reg.unpin(pin_id)}

    @op(admin=True)
    def pins(self, call: Call) -> dict:
        now = time.time()
        return {"pins": [p.row(now) for p in self.reg.pins.pins.values()]}

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
        force = _flag(args, "force")
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
