"""A local cluster: managers, CPU workers (and their logs) as child processes in a private
temporary directory. What `kvpool demo`, scripts/bench_router.py, the load generator's runs and
the multi-process tests start behind (or without) a front door.

One way to start a process (``spawn``: ``kvpool <args>`` in its own session, so a terminal's
Ctrl-C reaches only the parent, which stops the children in order) and one kill policy
(``stop``: SIGTERM to the workers, all at once, so they free and deregister; then to the
managers and the rest; whatever still runs after ``STOP_GRACE_S`` is killed).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch

from kvpool.client.generate import GenerateClient, WorkerUnavailable
from kvpool.shared.curve import ClientKeys
from kvpool.shared.procs import CLI
from kvpool.worker.config import PRESETS
from kvpool.worker.profiler import page_bytes

STOP_GRACE_S = 10.0


def worker_command(manager: str, pool: str, endpoint: str, *, model: str = "tiny", kv_blocks: int = 128,
                   block_size: int = 16, max_model_len: int = 512, seed: int = 0,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """`kvpool` arguments of a CPU worker of ``kv_blocks`` blocks (float32, one thread).

    One command line for every local cluster (the demo, bench_router, the multi-process tests),
    so they all run the same worker.
    """
    m = PRESETS[model]
    kv = kv_blocks * page_bytes(block_size, m.num_kv_heads, m.head_size, torch.float32) * m.num_layers
    return ["worker", "--manager", manager, "--pool", pool, "--endpoint", endpoint, "--model", model,
            "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--kv-cache-memory", str(kv), "--threads", "1", "--seed", str(seed),
            "--dtype", "float32", "--device", "cpu", *extra]


@dataclass(frozen=True)
class ClusterConfig:
    """What ``DevCluster.start`` runs: one manager and ``num_workers`` workers (pools demo-0, ...)."""

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


class DevCluster:
    """The processes, their logs and their sockets, in a private temporary directory.

    Either ``start()`` (the manager and ``cfg``'s workers, waited for), or piece by piece:
    ``manager()``, ``worker()``, ``spawn()`` for anything else.
    """

    def __init__(self, cfg: ClusterConfig | None = None, prefix: str = "kvpool-dev-") -> None:
        self.cfg = cfg or ClusterConfig()
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.manager_ep = f"ipc://{self.dir}/manager.sock"
        self.pools = [f"demo-{i}" for i in range(self.cfg.num_workers)]
        self.worker_eps = [f"ipc://{self.dir}/{p}.sock" for p in self.pools]
        self.procs: list[subprocess.Popen] = []  # in start order
        self.workers: list[subprocess.Popen] = []  # stopped first
        self.named: dict[str, subprocess.Popen] = {}
        self._logs: dict[int, str] = {}  # pid -> log file

    def spawn(self, args: list[str], name: str) -> subprocess.Popen:
        """``kvpool <args>`` in its own session, logging to ``<dir>/<name>.log``."""
        path = os.path.join(self.dir, f"{name}.log")
        with open(path, "wb") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self._logs[proc.pid] = path
        self.procs.append(proc)
        self.named[name] = proc
        return proc

    def manager(self, name: str = "manager", *extra: str) -> str:
        """Starts a manager at ``<dir>/<name>.sock``; returns its endpoint."""
        endpoint = f"ipc://{self.dir}/{name}.sock"
        self.spawn(["manager", "--manager", endpoint, *extra], name)
        return endpoint

    def start_manager(self) -> subprocess.Popen:
        """The manager at ``manager_ep`` (what ``start`` runs first)."""
        self.manager()
        return self.named["manager"]

    def worker(self, manager: str, pool: str, *, model: str = "tiny", kv_blocks: int = 128, block_size: int = 16,
               max_model_len: int = 512, seed: int = 0, extra: tuple[str, ...] = ()) -> str:
        """Starts a CPU worker (float32) of ``kv_blocks`` blocks; returns its generate endpoint."""
        endpoint = f"ipc://{self.dir}/{pool}.sock"
        self.workers.append(self.spawn(worker_command(
            manager, pool, endpoint, model=model, kv_blocks=kv_blocks, block_size=block_size,
            max_model_len=max_model_len, seed=seed, extra=extra), pool))
        return endpoint

    def start(self, timeout_s: float = 60.0, worker_args: tuple[str, ...] = (),
              curve: ClientKeys | None = None) -> None:
        """The manager, then ``cfg``'s workers, waited for (``worker_args`` added to each worker's
        command line; ``curve``: the keys to ping them with when their generate sockets run CURVE)."""
        self.start_manager()
        c = self.cfg
        for pool in self.pools:
            self.worker(self.manager_ep, pool, model=c.model, kv_blocks=c.kv_blocks, block_size=c.block_size,
                        max_model_len=c.max_model_len, seed=c.seed, extra=worker_args)
        for proc, ep in zip(self.workers, self.worker_eps):
            self.wait_ready(proc, ep, timeout_s, curve)

    def wait_ready(self, proc: subprocess.Popen, endpoint: str, timeout_s: float,
                   curve: ClientKeys | None = None) -> None:
        """Until the worker ``proc`` answers a ping at ``endpoint``; raises with its log if it exits."""
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

    def log_tail(self, which: subprocess.Popen | str, chars: int = 3000) -> str:
        """The end of a process's log (the process, or the name it was spawned as)."""
        proc = self.named[which] if isinstance(which, str) else which
        with open(self._logs[proc.pid], "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    def check_alive(self) -> None:
        """Raises with the log of the first process that has exited."""
        for name, p in self.named.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log_tail(p)}")

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would (no free, no deregistration)."""
        proc = self.named[name]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        """Workers first (all at once: they free and deregister), then the rest; the directory goes."""
        others = [p for p in self.procs if p not in self.workers]
        for group in (self.workers, others):
            live = [p for p in group if p.poll() is None]
            for proc in live:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in live:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
