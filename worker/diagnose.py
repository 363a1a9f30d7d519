"""Why a pool's worker cannot serve: asks the manager, briefly, what it knows of the pool.

Used by `kvpool generate` when the worker's socket is missing, dead or silent, so the error
names the real cause (a mistyped pool, a dead worker, a stopped manager) within a few seconds.
"""

from __future__ import annotations

from kvpool.client.manager import ManagerClient
from kvpool.shared.protocol import ManagerError, ManagerUnavailable


def pool_diagnosis(manager_endpoint: str, pool: str, timeout_s: float = 1.5) -> str:
    """One sentence on what the manager knows of ``pool`` (or that it cannot be reached)."""
    try:
        client = ManagerClient(manager_endpoint, role="observer", identity="kvpool-diagnose", timeout_s=timeout_s,
                               failover_s=0.0)
    except ValueError as e:
        return f"the manager cannot be asked ({e})"
    try:
        body = client.stats()
        try:
            client.deregister()
        except ManagerError:
            pass
    except ManagerUnavailable:
        return f"the manager at {manager_endpoint} does not answer either (is `kvpool manager` running?)"
    except ManagerError as e:
        return f"the manager refused to say ({e.code}: {e.message})"
    finally:
        client.close()
    pools = body.get("pools", {})
    draining = " The manager is draining (`kvpool drain --cancel` ends it)." if body["manager"].get("draining") else ""
    if pool not in pools:
        known = ", ".join(sorted(pools)[:10]) or "none"
        return f"the manager knows no pool {pool!r} (pools: {known}): is the pool name right?{draining}"
    health = pools[pool].get("health")
    if health == "lost":
        return f"the worker of pool {pool!r} died (its session expired): restart it.{draining}"
    if health == "idle":
        return f"the worker of pool {pool!r} stopped (it deregistered): start it again.{draining}"
    if health == "waiting":
        return f"pool {pool!r} is waiting for some of its shards to register.{draining}"
    return f"the manager still sees a live worker session for pool {pool!r}.{draining}"
