"""The worker's generate socket on the filesystem: who holds an ipc endpoint, and cleaning up.

A ZeroMQ ``bind`` on an ``ipc://`` path silently replaces a socket file that another process is
serving (that worker keeps running, unreachable). So before binding, a worker probes the path:

    absent   no file: bind
    stale    a file nobody answers on (a worker that died left it): remove it, bind
    serving  a worker answers ``ping`` there: refuse, unless the operator asked to replace it

On exit a worker removes its socket file, but only if the file is still the one it bound (a
replacement worker may have bound the same path since). So a stale file means the previous
worker on this endpoint died: a worker restarted after a crash takes its pool's shard over
without waiting for the dead one's session to expire (`kvpool worker` registers with replace).
"""

from __future__ import annotations

import logging
import os

from kvpool.client.generate import ping_once

logger = logging.getLogger(__name__)


class EndpointInUse(ValueError):
    """Another live worker serves the endpoint; the message says how to replace it."""


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def probe(endpoint: str, timeout_s: float = 1.0) -> tuple[str, str | None]:
    """("absent" | "stale" | "serving", the serving worker's pool name)."""
    path = ipc_path(endpoint)
    if path is not None and not os.path.exists(path):
        return "absent", None
    answered, pool = ping_once(endpoint, timeout_s)
    if answered:
        return "serving", pool
    return ("stale" if path is not None else "absent"), None


def claim(endpoint: str, pool: str, replace: bool) -> str:
    """Makes ``endpoint`` ready to bind for ``pool``'s worker, or raises EndpointInUse; returns
    what was there ("absent", "stale", "serving"). A tcp endpoint needs nothing: binding a port
    in use fails by itself ("absent")."""
    path = ipc_path(endpoint)
    if path is None:
        return "absent"
    state, owner = probe(endpoint)
    if state == "serving":
        if not replace:
            raise EndpointInUse(
                f"a live worker (pool {owner!r}) already serves {endpoint}; stop it first, or start this "
                "one with --replace to take over its socket and its pool")
        logger.warning("replacing the worker (pool %r) serving %s", owner, endpoint)
    if state in ("stale", "serving"):
        if state == "stale":
            logger.info("removing the stale socket file %s (no worker answers there)", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return state


def bound_inode(endpoint: str) -> int | None:
    """The inode of the ipc socket file just bound (to recognise it at exit)."""
    path = ipc_path(endpoint)
    try:
        return os.stat(path).st_ino if path is not None else None
    except OSError:
        return None


def release(endpoint: str, inode: int | None) -> None:
    """Removes our ipc socket file, unless another worker has bound the path since."""
    path = ipc_path(endpoint)
    if path is None or inode is None:
        return
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass
