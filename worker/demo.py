"""`kvpool demo`: a manager and two CPU workers as separate processes, prefix-aware routing.

Each request goes to the worker whose pool holds the longest cached prefix of its prompt (the
manager's ``locate`` op); ties go to the worker with fewer requests in flight. The workload has
shared system prompts, varied user lengths and output lengths, and some parallel-sampling
requests. The report compares peak blocks in use with what reserving max_model_len per running
request would have taken.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import torch
import zmq
from tqdm import tqdm

from kvpool.shared.curve import ClientKeys
from kvpool.shared.hashing import hash_blocks
from kvpool.worker.client import GenerateClient, WorkerUnavailable
from kvpool.worker.config import PRESETS
from kvpool.worker.manager_client import ManagerClient
from kvpool.worker.profiler import page_bytes

CLI = [sys.executable, "-c", "import sys; from kvpool.cli.main import cli; sys.exit(cli())"]


@dataclass(frozen=True)
class DemoConfig:
    num_requests: int = 200
    num_workers: int = 2
    num_system_prompts: int = 4
    system_len: tuple[int, int] = (48, 112)
    user_len: tuple[int, int] = (4, 160)
    max_tokens: tuple[int, int] = (8, 48)
    parallel_every: int = 8  # every k-th request samples n=2 (fork, copy-on-write)
    max_inflight: int = 32
    model: str = "tiny"
    block_size: int = 16
    max_model_len: int = 512
    kv_blocks: int = 128  # per worker
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_workers < 1 or self.max_inflight < 1:
            raise ValueError("num_requests, num_workers and max_inflight must be >= 1")
        if self.model not in PRESETS:
            raise ValueError(f"the demo runs a preset model ({', '.join(PRESETS)}), not {self.model!r}")
        if self.system_len[1] + self.user_len[1] + self.max_tokens[1] > self.max_model_len:
            raise ValueError("system_len + user_len + max_tokens maxima must fit max_model_len")


def workload(cfg: DemoConfig, vocab: int = 512) -> list[tuple[list[int], dict]]:
    rng = random.Random(cfg.seed)
    systems = [[rng.randrange(2, vocab) for _ in range(rng.randint(*cfg.system_len))]
               for _ in range(cfg.num_system_prompts)]
    out = []
    for i in range(cfg.num_requests):
        prompt = rng.choice(systems) + [rng.randrange(2, vocab) for _ in range(rng.randint(*cfg.user_len))]
        params = {"max_tokens": rng.randint(*cfg.max_tokens), "ignore_eos": True}
        if cfg.parallel_every and i % cfg.parallel_every == cfg.parallel_every - 1:
            params.update(n=2, temperature=0.8, seed=i)
        out.append((prompt, params))
    return out


class Cluster:
    """The manager and worker processes of the demo, in a private temporary directory."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.dir = tempfile.mkdtemp(prefix="kvpool-demo-")
        self.manager_ep = f"ipc://{self.dir}/manager.sock"
        self.pools = [f"demo-{i}" for i in range(cfg.num_workers)]
        self.worker_eps = [f"ipc://{self.dir}/{p}.sock" for p in self.pools]
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # Their own session: a terminal's Ctrl-C reaches only the demo, which stops them in order.
        proc = subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_manager(self) -> subprocess.Popen:
        return self._spawn(["manager", "--manager", self.manager_ep], "manager")

    def start(self, timeout_s: float = 60.0, worker_args: tuple[str, ...] = (), curve: ClientKeys | None = None) -> None:
        """The manager, then the workers (``worker_args`` added to each worker's command line;
        ``curve``: the keys to ping them with when their generate sockets run CURVE)."""
        self.start_manager()
        c = self.cfg
        m = PRESETS[c.model]
        kv_bytes = c.kv_blocks * page_bytes(c.block_size, m.num_kv_heads, m.head_size, torch.float32) * m.num_layers
        workers = []
        for pool, ep in zip(self.pools, self.worker_eps):
            workers.append(self._spawn(  # float32: the demo runs on CPU
                ["worker", "--manager", self.manager_ep, "--pool", pool, "--endpoint", ep,
                 "--model", c.model, "--block-size", str(c.block_size), "--max-model-len",
                 str(c.max_model_len), "--kv-cache-memory", str(kv_bytes), "--threads", "1",
                 "--seed", str(c.seed), "--dtype", "float32", "--device", "cpu", *worker_args], pool))
        self.workers = workers
        for proc, ep in zip(workers, self.worker_eps):
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

    def stop(self, fast: bool = False) -> None:
        """Workers first (all at once: they free and deregister), then the manager. ``fast``
        (Ctrl-C): everything at once, killed after 2 s; the demo's manager is private anyway."""
        others = [p for p in self.procs if p not in self.workers]
        for group in ([self.procs] if fast else [self.workers, others]):
            live = [p for p in group if p.poll() is None]
            for proc in live:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + (2 if fast else 10)
            for proc in live:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Router:
    """Longest cached prefix first (the manager's locate), then fewest requests in flight."""

    def __init__(self, manager_ep: str, pools: list[str], block_size: int) -> None:
        self.client = ManagerClient(manager_ep, role="router", timeout_s=5.0)
        self.pools, self.block_size = pools, block_size
        self.decisions = {"prefix": 0, "load": 0}
        self.per_pool = dict.fromkeys(pools, 0)

    def close(self) -> None:
        try:
            self.client.deregister()
        finally:
            self.client.close()

    def route(self, prompt: list[int], inflight: list[int]) -> int:
        cached = self.client.locate(hash_blocks(prompt, self.block_size))
        hits = [cached.get(p, 0) for p in self.pools]
        best = max(hits)
        ties = [i for i, h in enumerate(hits) if h == best]
        choice = min(ties, key=lambda i: inflight[i])
        self.decisions["prefix" if best > 0 and len(ties) == 1 else "load"] += 1
        self.per_pool[self.pools[choice]] += 1
        return choice


def drive(cfg: DemoConfig, cluster: Cluster, progress: bool = True) -> dict:
    """Runs the workload through the workers; returns the measured counters."""
    router = Router(cluster.manager_ep, cluster.pools, cfg.block_size)
    clients = [GenerateClient(ep) for ep in cluster.worker_eps]
    poller = zmq.Poller()
    for c in clients:
        poller.register(c.sock, zmq.POLLIN)
    todo = workload(cfg)
    inflight = [0] * len(clients)
    open_samples: dict[tuple[int, str], int] = {}
    tokens = 0
    bar = tqdm(total=len(todo), desc="requests", unit="req", disable=not progress)
    start = time.perf_counter()
    try:
        while todo or open_samples:
            while todo and len(open_samples) < cfg.max_inflight:
                prompt, params = todo.pop(0)
                w = router.route(prompt, inflight)
                open_samples[(w, clients[w].submit(prompt, **params))] = params.get("n", 1)
                inflight[w] += 1
            events = dict(poller.poll(30_000))
            if not events:
                raise RuntimeError("the workers sent nothing for 30s")
            for w, c in enumerate(clients):
                while c.sock in events and (msg := c.recv(0)) is not None:
                    key = (w, msg["id"])
                    if "error" in msg:
                        raise RuntimeError(f"worker {cluster.pools[w]} refused a request: {msg['error']}")
                    tokens += msg.get("token") is not None
                    if msg.get("finished"):
                        open_samples[key] -= 1
                        if open_samples[key] == 0:
                            del open_samples[key]
                            inflight[w] -= 1
                            bar.update(1)
        elapsed = time.perf_counter() - start
        stats = [c.call("stats")["stats"] for c in clients]
    finally:
        bar.close()
        for c in clients:
            c.close()
        router.close()
    return {"elapsed_s": elapsed, "generated_tokens": tokens, "workers": stats,
            "routing": {"by_prefix": router.decisions["prefix"], "by_load": router.decisions["load"],
                        "per_pool": router.per_pool}}


def report(cfg: DemoConfig, run: dict) -> dict:
    ws = run["workers"]
    per_request = -(-cfg.max_model_len // cfg.block_size)
    prompt = sum(w["prompt_tokens"] for w in ws)
    return {
        "config": asdict(cfg),
        "requests": cfg.num_requests,
        "elapsed_s": round(run["elapsed_s"], 3),
        "generated_tokens": run["generated_tokens"],
        "tokens_per_s": round(run["generated_tokens"] / run["elapsed_s"], 1),
        "prefix_hit_rate": round(sum(w["cached_tokens"] for w in ws) / prompt, 4) if prompt else 0.0,
        "preemptions": sum(w["preemptions"] for w in ws),
        "routing": run["routing"],
        "pools": [{"pool": w["pool"], "num_blocks": w["num_blocks"], "peak_blocks": w["peak_blocks"],
                   "peak_running": w["peak_running"],
                   "static_blocks": w["peak_running"] * per_request,
                   "preemptions": w["preemptions"]} for w in ws],
    }


def format_report(r: dict) -> str:
    lines = [
        f"requests            {r['requests']} in {r['elapsed_s']:.2f}s",
        f"generated tokens    {r['generated_tokens']}  ({r['tokens_per_s']:.0f} tokens/s)",
        f"prefix-cache hits   {r['prefix_hit_rate']:.1%} of prompt tokens",
        f"preemptions         {r['preemptions']}",
        f"routing             {r['routing']['by_prefix']} by cached prefix, {r['routing']['by_load']} by "
        f"load; per pool {r['routing']['per_pool']}",
    ]
    for p in r["pools"]:
        ratio = p["static_blocks"] / p["peak_blocks"] if p["peak_blocks"] else 0.0
        lines.append(
            f"pool {p['pool']:<14} peak {p['peak_blocks']} of {p['num_blocks'] - 1} blocks in use for "
            f"{p['peak_running']} running; static max-length preallocation: {p['static_blocks']} "
            f"blocks ({ratio:.1f}x)")
    return "\n".join(lines + ["", *EXPLAIN])


EXPLAIN = [
    "what the figures mean:",
    "  tokens/s            tokens sampled per second by both workers together, on CPU with a tiny model",
    "  prefix-cache hits   prompt tokens whose KV blocks were found cached (shared system prompts) and not recomputed",
    "  preemptions         requests paused and recomputed later because their pool ran out of free blocks",
    "  routing             requests sent where the manager's locate found the longest cached prefix, else to "
    "the less busy worker",
    "  peak ... blocks     the most KV blocks in use at once; 'static' is what reserving max_model_len per "
    "running request would have needed (paging's saving)",
]


def say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    """Runs the demo; with ``progress`` says on stderr what starts and how far it got."""
    cluster = Cluster(cfg)
    m = PRESETS[cfg.model]
    say(progress, f"starting a manager ({cluster.manager_ep}) and {cfg.num_workers} CPU workers, one pool each "
                  f"({', '.join(cluster.pools)}): model {cfg.model!r} ({m.num_layers} layers, seeded random "
                  f"weights), {cfg.kv_blocks} KV blocks of {cfg.block_size} tokens per worker, "
                  f"max_model_len {cfg.max_model_len}")
    say(progress, "waiting for the workers to load the model and register their pools (about 10 s)...")
    interrupted = False
    try:
        t0 = time.monotonic()
        cluster.start()
        say(progress, f"ready in {time.monotonic() - t0:.1f}s; sending {cfg.num_requests} requests, up to "
                      f"{cfg.max_inflight} at once, each to the worker holding its longest cached prefix")
        return report(cfg, drive(cfg, cluster, progress))
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # a 2nd Ctrl-C: cleanup still runs
        try:
            cluster.stop(fast=interrupted)
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
