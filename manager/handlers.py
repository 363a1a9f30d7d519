"""One function per manager op: validate ``args``, act on the registry, return the reply body.

Handlers raise ``ManagerError(code, message)`` for bad input; the server turns it into an error
reply. Each takes a ``Call`` (manager/ops.py: message id, session, args, clock); its session
is None only for hello. ``@op`` registers each one in the dispatch table (``OPS``) with whether
it needs a session and whether it is an admin op. The admin ops are manager/admin_ops.py's, the
external pools' manager/external/ops.py's, the node tier's and the pins' manager/node_ops.py's:
mixins of ``Handlers``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

from kvpool.manager.admin_ops import U63, AdminOps, flag, pool_summary
from kvpool.manager.engine_ops import EngineOps
from kvpool.manager.external.ops import ExternalOps
from kvpool.manager.guards import Bounds, check_owner, check_register, check_step, max_model_len
from kvpool.manager.health import pool_health
from kvpool.manager.node_ops import NodeOps
from kvpool.manager.ops import Call, op
from kvpool.manager.registry import Registry
from kvpool.manager.stats import ServerStats
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
from kvpool.shared.summaries import ServeInfo, WorkerRow


class Handlers(AdminOps, ExternalOps, NodeOps, EngineOps):
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
        self.configured: set[str] = set()  # external pools attached from the config (manager/external/ops.py)
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
            self.finish_node_batches(sess, entry, args["node_done"])
        decoded = decode_ops(ops)
        check_step(self.bounds, entry, sess.sid, decoded)
        t0 = time.perf_counter()
        results = self.reg.step(sess, entry, ops, call.msg_id, decoded)
        self.counters.step_latency.observe(time.perf_counter() - t0)
        self.counters.sub_ops += len(ops)
        return {"results": results}

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
            out.update(self.external_hits(hashes))
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
        if flag(args, "message_rows"):  # every recent message's timings, for a benchmark to join
            if not sess.admin:
                raise ManagerError("forbidden", "stats with message_rows is for admin sessions: hello with role "
                                   "'admin' (and the admin key, when the manager has one)")
            manager["message_rows"] = self.counters.message_times.columns()
        return {"manager": manager, "pools": pools, "store": self.store_stats()}
