"""Real Redis topologies a test starts on free 127.0.0.1 ports: Sentinel and Cluster.

- ``Sentinel``: a master, one or more replicas and three sentinels (``redis-server --sentinel``)
  watching service ``kvp``, with a 500 ms down-after, so a killed master fails over in seconds.
- ``cluster``: three masters (``--cluster-enabled yes``) joined by ``redis-cli --cluster create``.

Every process goes through the test's ``procs`` fixture (killed at teardown).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from helpers.durable import free_port, redis_server
from helpers.manager import wait_until

SERVICE = "kvp"


def cli(port: int, *args: str) -> str:
    out = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10)
    return out.stdout.strip()


class Sentinel:
    def __init__(self, spawn, directory: Path, replicas: int = 1) -> None:
        self.spawn, self.dir = spawn, directory
        self.master, self.master_port = redis_server(spawn, self._dir("master"))
        self.replica_ports = [redis_server(spawn, self._dir(f"replica{k}"), "--replicaof", "127.0.0.1",
                                           str(self.master_port))[1] for k in range(replicas)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        for port in self.sentinel_ports:
            conf = directory / f"sentinel-{port}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} 500\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n")
            spawn(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
        wait_until(self._ready, 30, "the sentinels to see the replica and each other")

    def _dir(self, name: str) -> str:
        d = self.dir / name
        d.mkdir()
        return str(d)

    def _ready(self) -> bool:
        port = self.sentinel_ports[0]
        replicas = cli(port, "SENTINEL", "REPLICAS", SERVICE)
        others = cli(port, "SENTINEL", "SENTINELS", SERVICE)
        synced = all("master_link_status:up" in cli(p, "INFO", "replication") for p in self.replica_ports)
        return synced and replicas.count("flags") == len(self.replica_ports) and others.count("flags") >= 2

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def master_addr(self) -> int:
        out = cli(self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE).split()
        return int(out[-1]) if out else -1


def cluster(spawn, directory: Path, masters: int = 3) -> list[int]:
    """Starts ``masters`` cluster-enabled nodes and joins them; returns their ports."""
    ports = []
    for k in range(masters):
        d = directory / f"node-{k}"
        d.mkdir()
        _, port = redis_server(spawn, str(d), "--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
        ports.append(port)
    out = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                          "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
    wait_until(lambda: all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in ports), 30, "the cluster")
    time.sleep(0.2)
    return ports
