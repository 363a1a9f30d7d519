"""One namespace's Redis calls: the registered scripts, the lease's fencing token, WAIT.

The Redis store (manager/store/redis_store.py) and its async writer (redis_async.py) write
through a ``RedisLink``; each call is one script of manager/store/redis_scripts.py, and a
redis-py error comes out as ``Fenced`` (another manager took the lease) or ``StoreUnavailable``
(nothing acknowledged). With ``min_replicas`` a write is followed, in the same round trip, by
WAIT for that many replicas, so a Sentinel failover loses nothing acknowledged.
"""

from __future__ import annotations

import time

from kvpool.manager.store.base import Fenced, StoreUnavailable
from kvpool.manager.store.redis_scripts import (
    ACQUIRE,
    COMMIT,
    READ,
    RELEASE,
    SNAPSHOT,
    namespace_keys,
)


def store_error(e: Exception) -> Exception:
    """A redis-py exception as Fenced or StoreUnavailable."""
    text = str(e)
    return Fenced(text) if text.startswith("FENCED") else StoreUnavailable(f"{type(e).__name__}: {text}")


class RedisLink:
    """The scripts of one namespace, run as ``owner`` under the fencing token ``acquire`` took.

    ``last_write`` is when a write last renewed the lease (the loop's or the async writer's
    thread); ``failures`` counts the calls that raised.
    """

    def __init__(self, client, namespace: str, *, owner: str, lease_ms: int, min_replicas: int = 0) -> None:
        self.r, self.owner, self.lease_ms = client, owner, lease_ms
        self.keys = namespace_keys(namespace)
        self._scripts = {name: client.register_script(src) for name, src in
                         (("commit", COMMIT), ("snapshot", SNAPSHOT), ("acquire", ACQUIRE), ("read", READ),
                          ("release", RELEASE))}
        self.token: str | None = None
        self.failures = 0
        # Replicas that must confirm each commit (WAIT) before it is acknowledged. The wait
        # stays inside the socket timeout.
        self.min_replicas = min_replicas
        timeout = client.get_connection_kwargs().get("socket_timeout") if hasattr(client, "get_connection_kwargs") else None
        self.wait_ms = max(10, int(float(timeout or 2.0) * 500))
        self.last_write = 0.0

    def renewal_due(self) -> bool:
        """A third of the lease passed since the last write: renew it even with nothing to append."""
        return time.monotonic() - self.last_write >= self.lease_ms / 3000

    def renewed(self) -> None:
        """A renewal was written or queued (the async writer's lands shortly)."""
        self.last_write = time.monotonic()

    def acquire(self) -> bool:
        """Takes the lease and a new fencing token; False while another manager holds it."""
        k = self.keys
        token = self._run("acquire", [k["lease"], k["fence"]], [self.owner, self.lease_ms])
        if token is None:
            return False
        self.token = str(token)
        self.last_write = time.monotonic()
        return True

    def read(self) -> list:
        """Snapshot, journal batches, seq and the clean-stop marker, read in one script."""
        k = self.keys
        return self._run("read", [k["snap"], k["journal"], k["seq"], k["clean"]], [])

    def write_blobs(self, first_seq: int, blobs: list[bytes]) -> None:
        """Appends journal batches ``first_seq``.. (none: renews the lease)."""
        run = self._run_replicated if self.min_replicas and blobs else self._run
        run("commit", self._commit_keys(), [self.token, self.owner, self.lease_ms, first_seq, *blobs])
        self.last_write = time.monotonic()

    def confirm_replicas(self) -> None:
        """A write that appends nothing, then WAIT: what is served now is on the replicas too."""
        self._run_replicated("commit", self._commit_keys(), [self.token, self.owner, self.lease_ms, 0])

    def renew(self, lease_ms: int) -> None:
        self._run("commit", self._commit_keys(), [self.token, self.owner, lease_ms, 0])
        self.last_write = time.monotonic()

    def write_snapshot(self, data: bytes, seq: int) -> None:
        self._run("snapshot", *self.snapshot_call(data, seq, self.token))

    def snapshot_call(self, data: bytes, seq: int, token: str | None) -> tuple[list[str], list]:
        """The snapshot script's keys and arguments (a forked child runs it on its own connection)."""
        k = self.keys
        return [k["fence"], k["lease"], k["snap"], k["journal"], k["seq"]], [token, self.owner, self.lease_ms, data, seq]

    def release(self, seq: int) -> None:
        """Gives the lease up, saying that nothing past ``seq`` was acknowledged."""
        self._run("release", [self.keys["lease"], self.keys["clean"]], [self.owner, seq])

    def close(self) -> None:
        self.r.close()

    def _commit_keys(self) -> list[str]:
        k = self.keys
        return [k["fence"], k["lease"], k["journal"], k["seq"]]

    def _run_replicated(self, name: str, keys: list[str], args: list):
        """The script, then WAIT for ``min_replicas`` in the same round trip; StoreUnavailable
        (nothing acknowledged) when fewer replicas confirm it in time."""
        import redis

        try:
            pipe = self.r.pipeline(transaction=False)
            self._scripts[name](keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.min_replicas, self.wait_ms)
            result, acked = pipe.execute()
        except redis.RedisError as e:
            self.failures += 1
            raise store_error(e) from None
        if acked < self.min_replicas:
            self.failures += 1
            raise StoreUnavailable(f"{acked} of {self.min_replicas} replicas (redis_min_replicas) confirmed the "
                                   f"commit within {self.wait_ms} ms")
        return result

    def _run(self, name: str, keys: list[str], args: list):
        import redis

        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.RedisError as e:
            self.failures += 1
            raise store_error(e) from None
