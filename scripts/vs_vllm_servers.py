"""The checkpoint and the two servers of scripts/bench_vs_vllm.py, and their CPU time from /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.shared.procs import CLI as KVPOOL_CLI
from kvpool.shared.procs import free_port

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 512, 8, 8, 4, 1536
VOCAB = 2048  # the tokenizer's target size; the model takes the trained tokenizer's actual size
BLOCK_SIZE, KV_BYTES, MAX_MODEL_LEN = 32, 1 << 30, 1024


def _corpus() -> list[str]:
    """Training text for the tokenizer: this repository's prose and code (deterministic)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted([*root.glob("*.md"), *root.glob("docs/*.md"), *root.glob("worker/*.py")])
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def build_checkpoint(path: Path, seed: int = 0, max_model_len: int = MAX_MODEL_LEN) -> Path:
    """A random-weight Llama (float32) and a byte-level BPE tokenizer, saved as transformers does;
    kept when ``path`` already holds one. ``max_model_len``: its max_position_embeddings."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": max_model_len}))
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=max_model_len,
        bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # unit-scale activations: transformers' 0.02 init ties every logit
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return path


def tree_cpu_seconds(roots: list[int]) -> float:
    """utime + stime of the processes ``roots`` and every live descendant (/proc, clock ticks)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields_ = raw[raw.rindex(")") + 2:].split()  # after "(comm)": state, ppid, ...
        stats[int(entry)] = fields_
        children.setdefault(int(fields_[1]), []).append(int(entry))
    total, todo, seen = 0, list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += int(stats[pid][11]) + int(stats[pid][12])  # utime, stime
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    name: str
    port: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    model: str = ""
    ready_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, cmd: list[str], log: Path, env: dict | None = None) -> None:
        with open(log, "wb") as f:
            self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               env={**os.environ, **(env or {})}, start_new_session=True))
        self.logs.append(log)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds([p.pid for p in self.procs])

    def poll_ready(self) -> bool:
        """Whether /v1/models names a model yet (then taken as the served name, and the time
        since start as ``ready_s``); raises when a process of the server exited."""
        for p, log in zip(self.procs, self.logs):
            if p.poll() is not None:
                raise RuntimeError(f"{self.name}: {log.name} exited {p.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as r:
                data = json.loads(r.read())["data"]
        except OSError:
            return False
        if data:
            self.model, self.ready_s = data[0]["id"], time.monotonic() - self.started
        return bool(data)

    def wait_ready(self, timeout: float = 900.0) -> None:
        wait_all_ready([self], timeout)

    def kill(self) -> None:
        """A crash: SIGKILL to every process group of the server, nothing drained."""
        self.stop(signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for p in reversed(self.procs):  # the front door first, the manager last
            if p.poll() is None:
                os.killpg(p.pid, sig)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_all_ready(servers: list[Server], timeout: float = 900.0) -> None:
    """Until every server answers; each one's ``ready_s`` is its own start-up time (they start
    together and are polled together)."""
    waiting, deadline = list(servers), time.monotonic() + timeout
    while waiting:
        waiting = [s for s in waiting if not s.poll_ready()]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(s.name for s in waiting)} not ready after {timeout:.0f} s")
        time.sleep(0.5 if waiting else 0)


def start_vllm(venv: str, checkpoint: str, tmp: Path, compile_: bool = False) -> Server:
    """`vllm serve` with 1 GiB of KV (VLLM_CPU_KVCACHE_SPACE), block size 32, prefix caching;
    ``--enforce-eager`` (no torch.compile or graphs) unless ``compile_``."""
    s = Server("vllm", free_port())
    cmd = [str(Path(venv) / "bin" / "vllm"), "serve", checkpoint, "--host", "127.0.0.1", "--port", str(s.port),
           "--dtype", "float32", "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
           "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "bench", "--disable-log-stats"]
    if not compile_:
        cmd.append("--enforce-eager")
    s.spawn(cmd, tmp / "vllm.log", {"VLLM_CPU_KVCACHE_SPACE": str(KV_BYTES >> 30)})
    return s


def kvpool_cli(checkout: Path) -> list[str]:
    """The `kvpool` command of another checkout, run by its own virtual environment
    (``bash scripts/install.sh`` there)."""
    python = checkout / ".venv" / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise SystemExit(f"no {python}: run `bash scripts/install.sh` in {checkout} first")
    return [str(python), *KVPOOL_CLI[1:]]


def start_kvpool(checkpoint: str, tmp: Path, threads: int = 0, worker_args: Sequence[str] = (), *,
                 name: str = "kvpool", cli: Sequence[str] = KVPOOL_CLI) -> Server:
    """A manager, `kvpool worker --model DIR --kv-cache-memory 1GiB` (and ``worker_args``) and
    `kvpool serve`, run by ``cli`` (another checkout's interpreter: `kvpool_cli`), their sockets
    and logs in ``tmp``."""
    s = Server(name, free_port())
    manager = f"ipc://{tmp}/manager.sock"
    s.spawn([*cli, "manager", "--manager", manager], tmp / "kvpool-manager.log")
    s.spawn([*cli, "worker", "--manager", manager, "--pool", "bench", "--endpoint", f"ipc://{tmp}/worker.sock",
             "--model", checkpoint, "--dtype", "float32", "--device", "cpu", "--block-size", str(BLOCK_SIZE),
             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(KV_BYTES), "--threads", str(threads), *worker_args],
            tmp / "kvpool-worker.log")
    s.spawn([*cli, "serve", "--manager", manager, "--host", "127.0.0.1", "--port", str(s.port)],
            tmp / "kvpool-serve.log")
    return s
