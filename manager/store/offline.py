"""Offline access to a namespace's state (``kvpool snapshot`` / ``kvpool restore``).

Reading needs no lease (one atomic script read, beside a running manager); writing fences out
any manager, whose next commit then fails (it exits and restarts on the new state).
"""

from __future__ import annotations

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.store.journal import recover
from kvpool.manager.store.redis_scripts import READ, namespace_keys
from kvpool.manager.store.view import StateView

# KEYS lease fence snap journal seq clean; ARGV snapshot seq force. A restored state is whole
# (nothing past its seq was acknowledged in it), as after a clean stop.
RESTORE = """
local h = redis.call('GET', KEYS[1])
if h and ARGV[3] ~= '1' then return redis.error_reply('LEASED: ' .. h) end
redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('SET', KEYS[3], ARGV[1])
redis.call('SET', KEYS[5], ARGV[2])
redis.call('SET', KEYS[6], ARGV[2])
return 1
"""


def read_state(client, namespace: str, reg: StateView, now: float) -> int:
    """Loads a namespace's state into the empty ``reg`` (one atomic read; no lease needed, so it
    works beside a running manager); returns its last batch seq. CorruptState when it is not whole."""
    k = namespace_keys(namespace)
    snap, blobs, seq, _ = client.register_script(READ)(keys=[k["snap"], k["journal"], k["seq"], k["clean"]], args=[])
    if not snap:
        raise CorruptState(f"namespace {namespace!r} holds no state" + (" but a journal" if blobs else ""))
    return recover(reg, snap, blobs, int(seq or -1), f"namespace {namespace!r}", now)[1]


def write_state(client, namespace: str, snapshot: bytes, seq: int, force: bool) -> None:
    """Replaces a namespace's state by ``snapshot``, fencing out any manager (its next commit
    fails). Raises ValueError while a manager holds the lease, unless ``force``."""
    import redis

    k = namespace_keys(namespace)
    try:
        client.register_script(RESTORE)(keys=[k["lease"], k["fence"], k["snap"], k["journal"], k["seq"], k["clean"]],
                                        args=[snapshot, seq, "1" if force else "0"])
    except redis.ResponseError as e:
        if str(e).startswith("LEASED"):
            raise ValueError(f"a manager holds the lease of namespace {namespace!r} ({str(e)[8:]}): stop it "
                             "first, or pass --force to fence it out (it exits and restarts on the new state)") from None
        raise
