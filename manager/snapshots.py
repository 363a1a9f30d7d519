"""A manager's whole state in and out of snapshot files and Redis namespaces, verified.

What ``kvpool snapshot`` and ``kvpool restore`` do, without the command line: every state read
here is decoded (manager/store/state_file.py: magic, SHA-256, msgpack), its journal replayed when
it comes from Redis, and every invariant checked before it is returned, written or restored.
Errors: ``CorruptState`` for a state that is not whole; ``StateIOError`` when a file or Redis
cannot be read or written (its message says what to change).
"""

from __future__ import annotations

import os
import time
import uuid

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.registry import Registry
from kvpool.manager.store.state_file import decode_state, dump_registry, encode_state, load_registry

__all__ = ["CorruptState", "StateIOError", "load_file", "load_namespace", "restore_namespace", "save_file", "summary"]


class StateIOError(Exception):
    """Redis could not be read or written, or a manager holds the namespace's lease."""


def _offline_registry() -> Registry:
    return Registry("offline", session_timeout_s=10.0)


def _verified(reg: Registry, what: str) -> None:
    try:
        reg.check_invariants()
    except AssertionError as e:
        raise CorruptState(f"{what}: an invariant is broken: {e}") from None


def load_file(path: str) -> tuple[Registry, int]:
    """The state in a snapshot file, verified, and its journal batch seq."""
    reg = _offline_registry()
    with open(path, "rb") as fh:
        seq = load_registry(decode_state(fh.read(), path), reg, time.monotonic())
    _verified(reg, path)
    return reg, seq


def save_file(reg: Registry, seq: int, path: str) -> int:
    """Writes ``reg`` to ``path`` atomically (never a half-written file under that name), mode
    0600 whatever the umask (it holds every session's bearer sid); returns the bytes written."""
    data = encode_state(dump_registry(reg, seq))
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(data)


def load_namespace(redis_url: str, namespace: str) -> tuple[Registry, int]:
    """A namespace's state (snapshot + journal, one atomic read beside a running manager), verified."""
    import redis

    from kvpool.manager.store.offline import read_state
    from kvpool.manager.store.redis_url import connect

    reg = _offline_registry()
    try:
        client = connect(redis_url)
        try:
            seq = read_state(client, namespace, reg, time.monotonic())
        finally:
            client.close()
    except (redis.RedisError, ValueError) as e:
        raise StateIOError(f"cannot read namespace {namespace!r} from {redis_url}: {e}") from None
    _verified(reg, f"namespace {namespace}")
    return reg, seq


def restore_namespace(reg: Registry, seq: int, redis_url: str, namespace: str, *, force: bool,
                      keep_state_id: bool) -> None:
    """Replaces a namespace's state by ``reg``, fencing out a running manager only with ``force``.
    Without ``keep_state_id`` the state gets a new id, so clients see a restart and recompute."""
    import redis

    from kvpool.manager.store.offline import write_state
    from kvpool.manager.store.redis_url import connect

    if not keep_state_id:
        reg.rename(uuid.uuid4().hex)
    try:
        client = connect(redis_url)
        try:
            write_state(client, namespace, encode_state(dump_registry(reg, seq)), seq, force)
        finally:
            client.close()
    except ValueError as e:
        raise StateIOError(str(e)) from None
    except redis.RedisError as e:
        raise StateIOError(f"cannot write namespace {namespace!r} at {redis_url}: {e}") from None


def summary(reg: Registry, seq: int) -> dict:
    """What a state holds, per pool, as plain data (``kvpool snapshot --json``)."""
    pools = []
    for e in reg.pools.values():
        p = e.pool
        pools.append({"pool": e.name, "state": e.state, "epoch": e.epoch, "shards": len(e.shards),
                      "num_blocks": p.blocks.num_blocks if p else 0, "free_blocks": p.blocks.num_free if p else 0,
                      "cached_blocks": len(p.blocks.cached) if p else 0, "requests": len(p.requests) if p else 0})
    return {"state_id": reg.state_id, "seq": seq, "sessions": len(reg.sessions), "draining": reg.draining,
            "pools": pools}
