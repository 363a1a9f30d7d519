"""Worker commands: `kvpool worker` serves a model, `kvpool generate` asks it, `kvpool demo`."""

from __future__ import annotations

import json
import os
import sys

import click

from kvpool.shared.protocol import ManagerError, default_endpoint

EXIT_UNREACHABLE = 3


def default_worker_endpoint(pool: str) -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvpool") if runtime else f"/tmp/kvpool-{os.getuid()}"
    os.makedirs(base, exist_ok=True)
    return f"ipc://{os.path.join(base, f'worker-{pool}.sock')}"


def _bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from kvpool.worker.config import parse_bytes

    try:
        return None if value is None else parse_bytes(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("worker")
@click.option("--manager", "-m", "manager_ep", envvar="KVPOOL_MANAGER", default=default_endpoint,
              show_default=True, help="Manager endpoint(s), comma-separated; env KVPOOL_MANAGER.")
@click.option("--pool", "-p", default="pool-0", show_default=True, help="Pool name (one per replica).")
@click.option("--model", default="tiny", show_default=True, help="A preset or a HF checkpoint directory.")
@click.option("--endpoint", default=None, help="Generate endpoint to bind [ipc://.../worker-POOL.sock].")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--max-model-len", default=1024, show_default=True)
@click.option("--max-num-batched-tokens", default=512, show_default=True)
@click.option("--max-num-seqs", default=64, show_default=True)
@click.option("--memory-utilization", default=0.9, show_default=True)
@click.option("--kv-cache-memory", default=None, callback=_bytes, help="KV bytes (e.g. 64MiB); skips profiling.")
@click.option("--cpu-memory-budget", default="2GiB", show_default=True, callback=_bytes,
              help="Host memory treated as the device on CPU.")
@click.option("--no-prefix-caching", is_flag=True, help="Send no block hashes (no prefix reuse).")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=0, help="torch CPU threads (0: torch's default).")
def worker(manager_ep: str, pool: str, model: str, endpoint: str | None, dtype: str, device: str,
           block_size: int, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
           memory_utilization: float, kv_cache_memory: int | None, cpu_memory_budget: int,
           no_prefix_caching: bool, seed: int, threads: int) -> None:
    """Serve generate requests from paged KV memory whose blocks the manager hands out."""
    import torch

    from kvpool.worker.block_manager import RemoteBlockManager
    from kvpool.worker.config import WorkerConfig
    from kvpool.worker.profiler import KVMemoryError
    from kvpool.worker.server import WorkerServer
    from kvpool.worker.startup import build_engine

    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = WorkerConfig(model=model, pool=pool, dtype=dtype, device=device, seed=seed,
                           block_size=block_size, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                           memory_utilization=memory_utilization, kv_cache_memory=kv_cache_memory,
                           cpu_memory_budget=cpu_memory_budget,
                           enable_prefix_caching=not no_prefix_caching)
        bm = RemoteBlockManager(manager_ep.split(","), pool)
        engine = build_engine(cfg, bm)
    except (ValueError, KVMemoryError) as e:
        raise click.ClickException(str(e)) from None
    except ManagerError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_UNREACHABLE if e.code == "unavailable" else 1)
    WorkerServer(engine, endpoint or default_worker_endpoint(pool), pool).serve()


@click.command("generate")
@click.argument("prompt_ids", nargs=-1, type=int, required=True)
@click.option("--worker", "-w", "endpoint", default=None, help="Worker endpoint [the pool's default].")
@click.option("--pool", "-p", default="pool-0", show_default=True, help="Pool whose default endpoint to use.")
@click.option("--max-tokens", default=16, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("-n", "n", default=1, show_default=True, help="Parallel samples.")
@click.option("--ignore-eos", is_flag=True)
@click.option("--timeout", "timeout_s", default=60.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per token message.")
def generate(prompt_ids: tuple[int, ...], endpoint: str | None, pool: str, max_tokens: int,
             temperature: float, top_p: float, seed: int | None, n: int, ignore_eos: bool,
             timeout_s: float, as_json: bool) -> None:
    """Generate from PROMPT_IDS (token ids); prints tokens as they stream in."""
    from kvpool.worker.client import GenerateClient, WorkerUnavailable

    params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "n": n,
              "ignore_eos": ignore_eos, **({"seed": seed} if seed is not None else {})}
    client = GenerateClient(endpoint or default_worker_endpoint(pool))
    try:
        for msg in client.stream(list(prompt_ids), timeout_s=timeout_s, **params):
            if as_json:
                click.echo(json.dumps(msg))
            elif msg.get("token") is not None:
                prefix = f"[{msg['index']}] " if n > 1 else ""
                click.echo(f"{prefix}{msg['token']}", nl=n > 1)
                if n == 1:
                    click.echo(" ", nl=False)
        if not as_json and n == 1:
            click.echo()
    except WorkerUnavailable as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    finally:
        client.close()


@click.command("demo")
@click.option("--requests", "num_requests", default=200, show_default=True)
@click.option("--max-inflight", default=32, show_default=True)
@click.option("--kv-blocks", default=128, show_default=True, help="KV blocks per worker.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(num_requests: int, max_inflight: int, kv_blocks: int, seed: int, as_json: bool) -> None:
    """A manager and two CPU workers serving a shared-prefix workload; prints a report."""
    from kvpool.worker.demo import DemoConfig, format_report, run_demo

    cfg = DemoConfig(num_requests=num_requests, max_inflight=max_inflight, kv_blocks=kv_blocks, seed=seed)
    try:
        result = run_demo(cfg, progress=not as_json)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result, indent=2) if as_json else format_report(result))
