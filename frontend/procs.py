"""Local managers and CPU workers as child processes, in a private temporary directory: what
`kvpool demo`, scripts/bench_router.py and the front door's tests run behind a front door."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import torch

from kvpool.worker.config import PRESETS
from kvpool.worker.profiler import page_bytes

CLI = [sys.executable, "-c", "import sys; from kvpool.cli.main import cli; sys.exit(cli())"]


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


class LocalCluster:
    def __init__(self, prefix: str = "kvpool-fd-") -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = proc
        return proc

    def manager(self, name: str = "manager", *extra: str) -> str:
        """Starts a manager; returns its endpoint."""
        endpoint = f"ipc://{self.dir}/{name}.sock"
        self._spawn(name, ["manager", "--manager", endpoint, *extra])
        return endpoint

    def worker(self, manager: str, pool: str, *, model: str = "tiny", kv_blocks: int = 128, block_size: int = 16,
               max_model_len: int = 512, seed: int = 0, extra: tuple[str, ...] = ()) -> str:
        """Starts a CPU worker (float32) of ``kv_blocks`` blocks; returns its generate endpoint."""
        endpoint = f"ipc://{self.dir}/{pool}.sock"
        self._spawn(pool, worker_command(manager, pool, endpoint, model=model, kv_blocks=kv_blocks,
                                         block_size=block_size, max_model_len=max_model_len, seed=seed,
                                         extra=extra))
        return endpoint

    def log_tail(self, name: str, chars: int = 3000) -> str:
        with open(os.path.join(self.dir, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        workers = [p for n, p in self.procs.items() if not n.startswith("manager")]
        managers = [p for p in self.procs.values() if p not in workers]
        for group in (workers, managers):  # workers free and deregister first, all at once
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
