"""How the loop loses and regains its state store: failed commits, recovery, standby, fencing.

The loop (manager/server.py) is *active* while it holds the store's lease and its state is the
store's. Otherwise it keeps answering, with an error and no state change:

- ``recovering``: a commit failed (Redis down or unreachable). The iteration's mutations may or
  may not have reached Redis, so the in-memory state is no longer trusted: every reply of that
  iteration becomes ``store_unavailable`` (nothing acknowledged), and every ``RECOVER_EVERY_S``
  the loop takes the lease again and reloads the whole state from Redis, then serves. A step
  that did commit is answered from the session's reply cache when the client retries it.
- ``standby``: another manager holds the lease; ``not_active`` tells clients to try their next
  endpoint. Every ``lease_ms / 5`` the loop tries to take the lease (it is free once the active
  one stops renewing it), then loads the state and serves.
- a client's request says it saw a commit this state lacks (``check_seen``): as a failed
  commit; the reload then serves a new state id, since the store went back in time.
- ``fenced``: a commit found another manager's fencing token (this one was paused or cut off
  past its lease and a standby took over): replies become ``not_active`` and the process exits
  with ``EXIT_FENCED``; systemd restarts it, as a standby.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
from typing import TYPE_CHECKING

from kvpool.manager.store.base import Fenced, MemoryStore, StateStore, StoreUnavailable
from kvpool.shared.bind import runtime_dir
from kvpool.shared.protocol import ManagerError, error_reply, unpack

if TYPE_CHECKING:
    from kvpool.manager.config import ManagerConfig
    from kvpool.manager.server import Server

logger = logging.getLogger(__name__)
RECOVER_EVERY_S = 0.5
EXIT_FENCED = 75  # EX_TEMPFAIL: another manager took the lease
INACTIVE = {
    "starting": ("store_unavailable", "the manager is loading its state: retry shortly"),
    "recovering": ("store_unavailable", "the state store (Redis) is unreachable: nothing is acknowledged until "
                   "it is back; retry (a step with the same id)"),
    "standby": ("not_active", "this manager is a standby (another one holds the lease): try the next endpoint"),
    "fenced": ("not_active", "this manager lost its lease to another one and is stopping: try the next endpoint"),
}


def open_store(cfg: ManagerConfig) -> StateStore:
    """The store ``cfg`` asks for: Redis with ``redis_url``, else memory."""
    if not cfg.redis_url:
        return MemoryStore()
    from kvpool.manager.store.redis_store import RedisStore
    from kvpool.manager.store.redis_url import connect

    owner = f"{socket.gethostname()}/{cfg.endpoint}"  # stable: a restarted manager takes its lease back at once
    high_water = cfg.high_water_file or os.path.join(runtime_dir(), f"{cfg.namespace}.seq")
    return RedisStore(connect(cfg.redis_url, cfg.redis_timeout_s), cfg.namespace, owner=owner,
                      durability=cfg.durability, lease_ms=cfg.lease_ms, snapshot_bytes=cfg.snapshot_bytes,
                      high_water_path=high_water, reconnect=lambda: connect(cfg.redis_url, cfg.redis_timeout_s),
                      min_replicas=cfg.redis_min_replicas)


def activate(server: Server, now: float) -> None:
    """Takes the lease and loads the state into a fresh registry, which the server's adopts
    only once it is whole. CorruptState propagates (the manager refuses to serve)."""
    was = server.mode
    server._next_activate = now + (server.cfg.lease_ms / 5000 if was == "standby" else RECOVER_EVERY_S)
    try:
        if not server.store.acquire():
            if was == "recovering":  # cut off past the lease, and a standby took over
                _fence(server, "the lease went to another manager while the store was unreachable")
            elif was != "standby":
                logger.warning("another manager holds the lease: standing by")
            server.mode = "standby"
            return
        fresh = server.new_registry(server.registry.incarnation)
        server.store.load(fresh, now)
    except StoreUnavailable as e:
        if was != "recovering":
            logger.error("state store unavailable: %s; answering store_unavailable until it is back", e)
        server.mode = "recovering"
        return
    except Fenced as e:
        _fence(server, str(e))
        return
    server.registry.adopt(fresh)
    server.mode, server.went_back = "active", None
    settle_heap()
    server._next_expiry = 0.0
    logger.warning("manager %s active: state %s, %d sessions, %d pools, %d requests", server.incarnation,
                   fresh.state_id, len(fresh.sessions), len(fresh.pools), fresh.total_requests())


def settle_heap() -> None:
    """Moves the state just loaded out of the garbage collector's sight (``gc.freeze``): the
    loop's idle collections then traverse only what changed since, never a 1M-block state."""
    gc.collect()
    gc.freeze()


def lost_store(server: Server, err: Exception, replies: list) -> list:
    """A commit failed: nothing of this iteration is acknowledged; stop serving until recovered."""
    reg = server.registry
    for entry in reg.pools.values():  # events of uncommitted mutations are never published
        if entry.pool is not None:
            entry.pool.blocks.events = [] if entry.pool.blocks.events is not None else None
    reg.log, reg.dirty = [], set()
    if isinstance(err, Fenced):
        _fence(server, str(err))
    else:
        logger.error("commit failed (%s): this iteration's %d replies become store_unavailable; "
                     "recovering from the store", err, sum(r is not None for r in replies))
        server.mode = "recovering"
        server._next_activate = 0.0
    code, message = INACTIVE[server.mode]
    return [_as_error(server, frames, ManagerError(code, message)) for frames in replies]


def check_seen(server: Server, seen: object) -> None:
    """A request says its client saw commit ``seen`` of this state; beyond the last commit, the
    store went back in time under this manager (Redis restored, a lagging replica promoted):
    nothing more is acknowledged, and the reload serves a new state (high_water.py)."""
    reg = server.registry
    if type(seen) is not int or seen <= reg.seq or not reg.durable:
        return
    server.went_back = f"a client saw commit {seen} of state {reg.state_id}, which ends at {reg.seq}"
    server.store.saw(reg.state_id, seen)
    raise ManagerError(*INACTIVE["recovering"])


def _fence(server: Server, why: str) -> None:
    logger.error("fenced: %s; this manager stops (exit %d) and must not write again", why, EXIT_FENCED)
    server.mode = "fenced"
    server.exit_code = EXIT_FENCED
    server.request_stop()


def _as_error(server: Server, frames: list[bytes] | None, err: ManagerError) -> list[bytes] | None:
    if frames is None:
        return None
    try:
        msg_id = unpack(frames[-1]).get("id")
    except Exception:
        msg_id = None
    server.stats.errors[err.code] += 1
    reg = server.registry
    return [*frames[:-1], error_reply(msg_id, reg.incarnation, err, reg.state_id)]
