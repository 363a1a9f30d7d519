"""A manager and CPU workers as separate processes, for the worker's multi-process tests.

Each process has its own session (a terminal's Ctrl-C reaches only pytest, whose fixtures stop
them in order) and its log in the cluster's private temporary directory. The worker command line
is the front door's (``kvpool.frontend.procs.worker_command``), so the tests start workers exactly
as ``kvpool demo`` does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from kvpool.client.generate import GenerateClient, WorkerUnavailable
from kvpool.frontend.procs import CLI, worker_command
from kvpool.shared.curve import ClientKeys
from kvpool.worker.config import PRESETS


@dataclass(frozen=True)
class ClusterConfig:
    num_workers: int = 2
    model: str = "tiny"
    block_size: int = 16
    max_model_len: int = 512
    kv_blocks: int = 128  # per worker
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if self.model not in PRESETS:
            raise ValueError(f"the cluster runs a preset model ({', '.join(PRESETS)}), not {self.model!r}")


class Cluster:
    """The manager and worker processes, in a private temporary directory."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.dir = tempfile.mkdtemp(prefix="kvpool-test-")
        self.manager_ep = f"ipc://{self.dir}/manager.sock"
        self.pools = [f"demo-{i}" for i in range(cfg.num_workers)]
        self.worker_eps = [f"ipc://{self.dir}/{p}.sock" for p in self.pools]
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []

    def spawn(self, args: list[str], name: str) -> subprocess.Popen:
        """``kvpool <args>`` in its own session, logging to ``<dir>/<name>.log``."""
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_manager(self) -> subprocess.Popen:
        return self.spawn(["manager", "--manager", self.manager_ep], "manager")

    def start(self, timeout_s: float = 60.0, worker_args: tuple[str, ...] = (),
              curve: ClientKeys | None = None) -> None:
        """The manager, then the workers (``worker_args`` added to each worker's command line;
        ``curve``: the keys to ping them with when their generate sockets run CURVE)."""
        self.start_manager()
        c = self.cfg
        self.workers = [
            self.spawn(worker_command(self.manager_ep, pool, ep, model=c.model, kv_blocks=c.kv_blocks,
                                   block_size=c.block_size, max_model_len=c.max_model_len, seed=c.seed,
                                   extra=worker_args), pool)
            for pool, ep in zip(self.pools, self.worker_eps)
        ]
        for proc, ep in zip(self.workers, self.worker_eps):
            self.wait_ready(proc, ep, timeout_s, curve)

    def wait_ready(self, proc: subprocess.Popen, endpoint: str, timeout_s: float,
                   curve: ClientKeys | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        client = GenerateClient(endpoint, curve=curve)
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {proc.returncode}:\n{self.log_tail(proc)}")
                try:
                    client.call("ping", timeout_s=0.5)
                    return
                except WorkerUnavailable:
                    continue
            raise RuntimeError(f"worker at {endpoint} not ready in {timeout_s}s:\n{self.log_tail(proc)}")
        finally:
            client.close()

    @staticmethod
    def log_tail(proc: subprocess.Popen, chars: int = 3000) -> str:
        with open(proc.log_path, "rb") as f:  # type: ignore[attr-defined]
            return f.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        """Workers first (all at once: they free and deregister), then the manager."""
        others = [p for p in self.procs if p not in self.workers]
        for group in (self.workers, others):
            live = [p for p in group if p.poll() is None]
            for proc in live:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            for proc in live:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
