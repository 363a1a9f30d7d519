"""Which state store a manager's config asks for (manager/store/ holds the stores themselves)."""

from __future__ import annotations

import os
import socket

from kvpool.manager.config import ManagerConfig
from kvpool.manager.store.base import MemoryStore, StateStore
from kvpool.shared.bind import runtime_dir


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
