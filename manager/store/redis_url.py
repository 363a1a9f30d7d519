"""Redis connection URLs: standalone, Sentinel or Cluster, one string each (redis-py clients).

    redis://[:password@]host:port[/db]       standalone (also rediss:// for TLS, unix:///path.sock)
    redis+sentinel://[:password@]host:port[,host:port...]/service[/db]
                                             the master of ``service``, found through Sentinel
    redis+cluster://[:password@]host:port[,host:port...]
                                             a Redis Cluster (every key of a manager namespace
                                             shares one hash tag, so one slot: see redis_store.py)

Clients never retry a command by themselves (a commit that timed out must not be re-sent
blindly; the store's scripts make its own retries safe) and time out after ``timeout_s``, so a
stopped or unreachable Redis turns into errors the manager answers with, never a hung loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")


@dataclass
class RedisTarget:
    kind: str  # "standalone" | "sentinel" | "cluster"
    url: str  # standalone: the URL itself, for redis-py's from_url
    hosts: list[tuple[str, int]]
    service: str | None = None
    db: int = 0
    password: str | None = None
    username: str | None = None


def parse_redis_url(url: str) -> RedisTarget:
    """Raises ValueError saying what a valid URL looks like."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"redis URL {url!r}: the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if parts.scheme in ("redis", "rediss", "unix"):
        return RedisTarget("standalone", url, [])
    netloc = parts.netloc
    user = password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        user, password = unquote(user) or None, unquote(password) or None
    hosts = [_host_port(h, url) for h in netloc.split(",") if h]
    if not hosts:
        raise ValueError(f"redis URL {url!r} names no host:port")
    path = [p for p in parts.path.split("/") if p]
    if parts.scheme == "redis+cluster":
        if path:
            raise ValueError(f"redis URL {url!r}: a cluster URL has no path (Cluster has only db 0)")
        return RedisTarget("cluster", url, hosts, password=password, username=user)
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"redis URL {url!r}: a sentinel URL is redis+sentinel://host:port[,host:port]/SERVICE[/DB]")
    return RedisTarget("sentinel", url, hosts, path[0], int(path[1]) if len(path) == 2 else 0, password, user)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"redis URL {url!r}: {text!r} is not host:port")
    return host.strip("[]"), int(port)


def connect(url: str, timeout_s: float = 2.0):
    """A redis-py client for ``url`` (``redis.Redis`` or ``redis.cluster.RedisCluster``)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    target = parse_redis_url(url)
    common = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0)}
    if target.kind == "standalone":
        return redis.Redis.from_url(url, **common)
    auth = {"password": target.password, "username": target.username}
    if target.kind == "sentinel":
        from redis.sentinel import Sentinel

        sentinel = Sentinel(target.hosts, sentinel_kwargs={"socket_timeout": timeout_s}, **common)
        return sentinel.master_for(target.service, db=target.db, **auth, **common)
    from redis.cluster import ClusterNode, RedisCluster

    nodes = [ClusterNode(h, p) for h, p in target.hosts]
    return RedisCluster(startup_nodes=nodes, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **auth)
