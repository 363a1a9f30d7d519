"""A manager with a node tier and CPU workers of the `tiny` preset as real processes, and what
the node-tier tests ask of them: greedy outputs, the ground truth, stats, the stores' files."""

from __future__ import annotations

import os
import resource
import subprocess
import time
from pathlib import Path

import torch

from kvpool.client.generate import GenerateClient
from kvpool.client.manager import ManagerClient
from kvpool.devcluster.cluster import DevCluster, worker_command
from kvpool.shared.hashing import BlockHasher
from kvpool.shared.procs import CLI
from kvpool.worker.checkpoint import load_model
from kvpool.worker.config import PRESETS
from kvpool.worker.reference import reference_generate

HEADER_KEY = slice(32, 64)  # a slot header's key (worker/node_layout.py HEADER)
_MODEL: list = []


def truth(prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the tiny preset (seed 0) on a contiguous cache: no pool, no tier."""
    if not _MODEL:
        _MODEL.append(load_model("tiny", torch.float32, "cpu", 0))
    return reference_generate(_MODEL[0], prompt, n, PRESETS["tiny"].eos_token_ids)


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, PRESETS["tiny"].vocab_size, (n,), generator=g).tolist()


def hashes(prompt: list[int], block_size: int = 16) -> list[bytes]:
    h = BlockHasher(block_size)
    h.append(prompt)
    return list(h.hashes)


def generate(endpoint: str, prompt: list[int], n: int, timeout_s: float = 120.0) -> list[int]:
    client = GenerateClient(endpoint)
    try:
        return [m.token for m in client.stream(prompt, timeout_s=timeout_s, max_tokens=n, temperature=0.0)
                if m.token is not None]
    finally:
        client.close()


def worker_stats(endpoint: str) -> dict:
    client = GenerateClient(endpoint)
    try:
        return client.stats(timeout_s=30.0)
    finally:
        client.close()


class Admin:
    """Admin calls, each in a session of its own: the cluster's short session timeout (for the
    kill test) would expire one kept idle between calls."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def call(self, op: str, **args: object) -> dict:
        client = ManagerClient(self.endpoint, role="admin", timeout_s=30.0)
        try:
            return client.call(op, **args)
        finally:
            client.close()

    def stats(self) -> dict:
        return self.call("stats")


class NodeCluster:
    """A manager with a node tier (host level under ``tmp/shm``, disk level under ``tmp/disk``)
    and workers started one by one."""

    def __init__(self, tmp: Path, host: str = "1MiB", disk: str = "2MiB", policy: str = "write_through",
                 session_timeout_s: float = 3.0) -> None:
        self.cluster = DevCluster(prefix="kvpool-nt-")
        self.shm, self.disk = tmp / "shm", tmp / "disk"
        self.shm.mkdir(exist_ok=True)
        self.args = ["--node-tier-memory", host, "--node-tier-dir", str(self.shm), "--node-tier-disk", str(self.disk),
                     "--node-tier-disk-size", disk, "--node-tier-policy", policy,
                     "--session-timeout", str(session_timeout_s)]
        self.endpoint = self.cluster.manager("manager", *self.args)
        self.eps: dict[str, str] = {}

    def worker(self, pool: str, fsize_limit: int | None = None, **kw: object) -> str:
        """Starts a worker of pool ``pool`` and waits for it; ``fsize_limit``: the most bytes it
        may write to one file (RLIMIT_FSIZE: writes beyond fail with EFBIG, a full disk)."""
        c = self.cluster
        if fsize_limit is None:
            ep = c.worker(self.endpoint, pool, kv_blocks=64, **kw)  # type: ignore[arg-type]
        else:
            ep = f"ipc://{c.dir}/{pool}.sock"
            args = worker_command(self.endpoint, pool, ep, kv_blocks=64, **kw)  # type: ignore[arg-type]
            log = open(os.path.join(c.dir, f"{pool}.log"), "wb")  # noqa: SIM115 (the process keeps it)

            def limit() -> None:
                os.setsid()
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

            proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            c._logs[proc.pid] = log.name
            c.procs.append(proc)
            c.workers.append(proc)
            c.named[pool] = proc
        c.wait_ready(c.named[pool], ep, 180.0)
        self.eps[pool] = ep
        return ep

    def restart_manager(self) -> None:
        """SIGKILL, then the same manager (no persistent store: it starts empty)."""
        self.cluster.kill("manager")
        self.cluster.manager("manager", *self.args)

    @property
    def admin(self) -> Admin:
        return Admin(self.endpoint)

    def tier(self) -> dict:
        (usage,) = self.admin.stats()["manager"]["node_tiers"].values()
        return usage

    def pool(self, name: str) -> dict:
        return self.admin.stats()["pools"][name]

    def settled(self, timeout_s: float = 60.0) -> dict:
        """The tier's stats once no batch is open (every worker reported what it ran)."""
        deadline = time.monotonic() + timeout_s
        while True:
            usage = self.tier()
            if usage["batches"] == 0 or time.monotonic() > deadline:
                return usage
            time.sleep(0.1)

    def disk_files(self, keys: list[bytes]) -> dict[bytes, Path]:
        """The disk level's file of each of ``keys`` it holds (read from the slots' headers)."""
        out = {}
        for d in self.disk.iterdir():
            for f in d.glob("*.kv"):
                key = f.read_bytes()[HEADER_KEY]
                if key in keys:
                    out[key] = f
        return out

    def stop(self) -> None:
        self.cluster.stop()
