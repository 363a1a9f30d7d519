"""Worker commands: `kvpool worker` serves a model, `kvpool generate` asks it, `kvpool demo` (text
through the front door: devcluster/demo.py)."""

from __future__ import annotations

import json
import logging
import os
import sys

import click

from kvpool.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TP_PEER_LOST,
    EXIT_UNREACHABLE,
    curve_options,
    export_curve_env,
    log_options,
)
from kvpool.shared.generate import TokenMessage
from kvpool.shared.protocol import ManagerError, default_endpoint


def default_worker_endpoint(pool: str) -> str:
    """ipc://RUNTIME_DIR/worker-POOL.sock, in a directory that must be this user's alone."""
    from kvpool.shared.bind import ensure_private_dir, runtime_dir

    base = runtime_dir()
    try:
        ensure_private_dir(base)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    return f"ipc://{os.path.join(base, f'worker-{pool}.sock')}"


def _bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from kvpool.worker.config import parse_bytes

    try:
        return None if value is None else parse_bytes(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _default_tp_master() -> str:
    return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"


def worker_service_options(f):
    """Metrics, logs and CURVE options of `kvpool worker` (None: the config file's / default)."""
    f = click.option("--curve-allowed-keys-dir", default=None,
                     help="Directory of the NAME.key files of clients allowed on the generate socket.")(f)
    f = click.option("--curve-secret-key-file", default=None,
                     help="This worker's NAME.key_secret: CURVE on its generate socket (`kvpool keygen`).")(f)
    f = click.option("--metrics-port", type=int, default=None, help="Prometheus /metrics TCP port; 0: off [0].")(f)
    f = click.option("--metrics-host", default=None, help="Address of the metrics endpoint [127.0.0.1].")(f)
    f = click.option("--insecure", is_flag=True, default=None,
                     help="Allow a non-loopback TCP --endpoint without CURVE (a trusted, isolated network only).")(f)
    return curve_options(log_options(f))


@click.command("worker")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Config file (.toml with a [worker] table) [/etc/kvpool/worker.toml if it exists]; "
                   "KVPOOL_WORKER_<FIELD> environment variables override it, options given here override both.")
@click.option("--manager", "-m", "manager_ep", envvar="KVPOOL_MANAGER", default=default_endpoint,
              show_default=True, help="Manager endpoint(s), comma-separated; env KVPOOL_MANAGER.")
@click.option("--pool", "-p", default="pool-0", show_default=True, help="Pool name (one per replica).")
@click.argument("model_arg", required=False, metavar="[MODEL]")
@click.option("--model", default="tiny", show_default=True,
              help="A Hugging Face checkpoint directory, or a preset (tiny, small, llama-3-8b, llama-3.2-1b, "
                   "qwen2-0.5b): a preset is only the architecture's shape, with seeded random weights, not "
                   "the trained model. Also taken as the first argument, as `vllm serve MODEL`.")
@click.option("--served-model-name", default=None,
              help="The model id clients ask for [the --model value], as vLLM's flag.")
@click.option("--endpoint", default=None, help="Generate endpoint to bind [ipc://.../worker-POOL.sock].")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--max-model-len", default=None, type=int,
              help="Tokens per request, prompt and output [the model's own max_position_embeddings, as vLLM]; "
                   "a longer value is refused before the model loads.")
@click.option("--max-num-batched-tokens", default=2048, show_default=True,
              help="Tokens one step computes (prefill chunks beside decodes), vLLM's default too.")
@click.option("--max-num-seqs", default=64, show_default=True)
@click.option("--memory-utilization", "--gpu-memory-utilization", "memory_utilization", default=0.9,
              show_default=True, help="Share of the device memory for the model and its KV (vLLM's name too).")
@click.option("--kv-cache-memory", default=None, callback=_bytes, help="KV bytes (e.g. 64MiB); skips profiling.")
@click.option("--cpu-memory-budget", default="2GiB", show_default=True, callback=_bytes,
              help="Host memory treated as the device on CPU.")
@click.option("--host-kv-memory", default="0", show_default=True, callback=_bytes,
              help="Host memory for the pool's host KV tier (e.g. 4GiB); 0: none.")
@click.option("--host-kv-policy", type=click.Choice(["demote", "write_through"]), default="demote",
              show_default=True, help="When blocks reach the host tier: demote at eviction, or write "
              "through when a block becomes full (docs/operating.md).")
@click.option("--node-tier/--no-node-tier", "node_tier", default=None,
              help="Use the manager's node tier of this model's layout when it runs one (the default; "
              "single-shard pools; docs/operating.md, \"The node tier\").")
@click.option("--node-tier-read-timeout", type=float, default=None,
              help="Seconds a step waits for its node-tier disk reads, and then for its write-downs; a "
              "read later than that is recomputed, a late write dropped, never waited on [5].")
@click.option("--no-prefix-caching", is_flag=True, help="Send no block hashes (no prefix reuse).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "enable_prefix_caching", default=None,
              help="vLLM's names: prefix caching on (the default) or off.")
@click.option("--no-overlap", is_flag=True, help="Wait for the manager before each forward pass "
              "(default: send step N+1 while step N computes).")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=0, help="torch CPU threads (0: the usable cores less one, at least 1).")
@click.option("--tp-size", "--tensor-parallel-size", "-tp", "tp_size", default=1, show_default=True,
              help="Tensor-parallel ranks of this pool; without --tp-rank, start them all here.")
@click.option("--tp-rank", default=None, type=int, help="This process's rank (0 runs the scheduler).")
@click.option("--tp-master", envvar="KVPOOL_TP_MASTER", default=_default_tp_master, show_default=True,
              help="host:port where rank 0 hosts the process group; env KVPOOL_TP_MASTER.")
@click.option("--tp-timeout", default=60.0, show_default=True,
              help="Seconds a rank may go silent before the others take it for dead.")
@click.option("--replace", is_flag=True,
              help="Take over the pool (and the generate socket) from a worker that is still running; "
                   "without it a live worker's pool is refused.")
@worker_service_options
@click.pass_context
def worker(ctx: click.Context, config_path: str | None, manager_ep: str, pool: str, model_arg: str | None, model: str,
           endpoint: str | None, dtype: str, device: str,
           block_size: int, max_model_len: int | None, max_num_batched_tokens: int, max_num_seqs: int,
           memory_utilization: float, kv_cache_memory: int | None, cpu_memory_budget: int,
           host_kv_memory: int, host_kv_policy: str, no_prefix_caching: bool, no_overlap: bool, seed: int,
           threads: int, tp_size: int,
           tp_rank: int | None, tp_master: str, tp_timeout: float, replace: bool, **_: object) -> None:
    """Serve generate requests from paged KV memory whose blocks the manager hands out.

    With --tp-size N the pool is one model over N ranks (one process, one GPU each), each holding
    its slice of the KV heads; rank 0 serves requests, every rank registers as a shard.
    """
    cfg, source = _worker_config(ctx, config_path, no_prefix_caching, no_overlap, model_arg)
    export_curve_env(ctx)  # every ManagerClient of this process and of its tensor-parallel ranks
    if cfg.tp_size > 1 and tp_rank is None:
        from kvpool.worker.launch import launch

        sys.exit(launch(sys.argv[1:], cfg.tp_size))
    import torch

    from kvpool.cli.layered import summary
    from kvpool.shared.logs import setup_logging

    setup_logging(cfg.log_level, cfg.json_logs)
    logging.getLogger(__name__).info("config: %s", summary(cfg, source))
    from kvpool.worker.config import resolve_threads

    torch.set_num_threads(resolve_threads(cfg.threads, cfg.tp_size))
    _serve_rank(cfg, cfg.manager.split(","), cfg.endpoint or default_worker_endpoint(cfg.pool), tp_master, tp_timeout,
                replace)


def _worker_config(ctx: click.Context, config_path: str | None, no_prefix_caching: bool, no_overlap: bool,
                   model_arg: str | None = None):
    """Defaults < config file < KVPOOL_WORKER_* < options given (cli/layered.py)."""
    from kvpool.cli.layered import explicit_flags, load_service

    flags, labels = explicit_flags(ctx, "worker", {"manager_ep": "manager"})
    if model_arg is not None:
        if "model" in flags and flags["model"] != model_arg:
            raise click.UsageError(f"the model is given twice: {model_arg!r} and --model {flags['model']!r}")
        flags["model"], labels["model"] = model_arg, "argument"
    if no_prefix_caching:
        flags["enable_prefix_caching"], labels["enable_prefix_caching"] = False, "flag"
    if no_overlap:
        flags["overlap"], labels["overlap"] = False, "flag"
    return load_service("worker", config_path, flags, labels)


def _serve_rank(cfg, manager_eps: list[str], endpoint: str, tp_master: str, tp_timeout: float,
                replace: bool = False) -> None:
    """One worker, or one tensor-parallel rank: joins the group, loads its share, serves/follows."""
    from kvpool.worker.parallel import TPPeerLost
    from kvpool.worker.profiler import KVMemoryError
    from kvpool.worker.startup import serve_rank

    try:
        serve_rank(cfg, manager_eps, endpoint, tp_master, tp_timeout, replace)
    except (ValueError, KVMemoryError) as e:
        raise click.ClickException(str(e)) from None
    except ManagerError as e:
        hint = "; to take the pool over from it: kvpool worker --replace" if e.code == "not_owner" else ""
        click.echo(f"Error: {e}{hint}", err=True)
        sys.exit(EXIT_UNREACHABLE if e.code == "unavailable" else 1)
    except TPPeerLost as e:
        click.echo(f"Error: tensor-parallel rank {cfg.tp_rank} of pool {cfg.pool!r} stops: {e}. The pool's "
                   "epoch moves on when the lost shard's session ends or it re-registers; restart every "
                   "rank of the pool.", err=True)
        sys.exit(EXIT_TP_PEER_LOST)


@click.command("generate")
@click.argument("prompt_ids", nargs=-1, type=click.IntRange(0, 2**32 - 1), required=True)
@click.option("--worker", "-w", "endpoint", default=None, help="Worker endpoint [the pool's default].")
@click.option("--pool", "-p", default="pool-0", show_default=True, help="Pool whose default endpoint to use.")
@click.option("--manager", "-m", "manager_ep", envvar="KVPOOL_MANAGER", default=default_endpoint,
              show_default=True, help="Manager to ask why a pool's worker cannot serve; env KVPOOL_MANAGER.")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1, 2**31 - 1))
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=click.IntRange(0, 2**63 - 1))
@click.option("-n", "n", default=1, show_default=True, type=click.IntRange(1, 256), help="Parallel samples.")
@click.option("--ignore-eos", is_flag=True)
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds the whole request may take.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per token message.")
@click.option("--worker-key", envvar="KVPOOL_WORKER_CURVE_KEY", default=None,
              help="The worker's public key (NAME.key or Z85 text) when it runs CURVE; env KVPOOL_WORKER_CURVE_KEY.")
@click.option("--curve-key-file", envvar="KVPOOL_CURVE_KEY_FILE", default=None,
              help="This client's NAME.key_secret (CURVE); env KVPOOL_CURVE_KEY_FILE.")
def generate(prompt_ids: tuple[int, ...], endpoint: str | None, pool: str, manager_ep: str, max_tokens: int,
             temperature: float, top_p: float, seed: int | None, n: int, ignore_eos: bool,
             timeout_s: float, as_json: bool, worker_key: str | None, curve_key_file: str | None) -> None:
    """Generate from PROMPT_IDS (token ids); prints tokens as they stream in.

    How each sample finished goes to stderr ("finished: length" ...). Exit status: 0 when every
    sample finished normally (stop, length), 1 when the worker refused the request or a sample
    ended with an error or was aborted by the worker (it shut down), 3 when the worker cannot
    serve (no worker, it died, the manager is draining or unreachable: the message says which),
    130 on Ctrl-C. A request given up for any reason is aborted on the worker.
    """
    from kvpool.client.generate import GenerateClient, WorkerUnavailable
    from kvpool.shared.curve import ClientKeys

    try:
        curve = ClientKeys.load(worker_key, curve_key_file) if worker_key else None
    except ValueError as e:
        raise click.ClickException(str(e).replace("--curve-server-key", "--worker-key")) from None

    params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "n": n,
              "ignore_eos": ignore_eos, **({"seed": seed} if seed is not None else {})}
    client = GenerateClient(endpoint or default_worker_endpoint(pool), curve=curve)
    counts, reasons = [0] * n, ["?"] * n
    try:
        for msg in client.stream(list(prompt_ids), timeout_s=timeout_s, **params):
            _print_token(msg, n, as_json)
            counts[msg.index] += msg.token is not None
            if msg.finished:
                reasons[msg.index] = msg.reason or "?"
        if not as_json and n == 1:
            click.echo()
    except WorkerUnavailable as e:
        hint = "" if endpoint or e.cause in ("draining",) else f"; {_diagnosis(manager_ep, pool)}"
        click.echo(f"Error: {e}{hint}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("\ninterrupted: the request was aborted on the worker", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        client.close()
    sys.exit(_finish_report(reasons, counts, max_tokens))


def _print_token(msg: TokenMessage, n: int, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(msg.to_wire()))
    elif msg.token is not None:
        prefix = f"[{msg.index}] " if n > 1 else ""
        click.echo(f"{prefix}{msg.token}", nl=n > 1)
        if n == 1:
            click.echo(" ", nl=False)


def _diagnosis(manager_ep: str, pool: str) -> str:
    from kvpool.worker.diagnose import pool_diagnosis

    return pool_diagnosis(manager_ep, pool)


def _finish_report(reasons: list[str], counts: list[int], max_tokens: int) -> int:
    """Prints how each sample finished (stderr); the exit status: 1 if one ended with an error."""
    failed = False
    for i, (reason, count) in enumerate(zip(reasons, counts)):
        label = f"sample {i}: " if len(reasons) > 1 else ""
        note = ""
        if reason == "length" and count < max_tokens:
            note = f" (cut at the worker's max_model_len after {count} of {max_tokens} tokens)"
        elif reason == "abort":
            note = " (the worker stopped the request: it is shutting down or was told to abort)"
            failed = True
        elif reason.startswith("error") or reason == "?":
            failed = True
        click.echo(f"{label}finished: {reason}{note}", err=True)
    return EXIT_ERROR if failed else EXIT_OK


@click.command("demo")
@click.option("--requests", "num_requests", default=200, show_default=True)
@click.option("--max-inflight", default=32, show_default=True)
@click.option("--kv-blocks", default=128, show_default=True, help="KV blocks per worker.")
@click.option("--tenants", default=4, show_default=True, help="Tenants, each with its own system prompt and salt.")
@click.option("--policy", type=click.Choice(["kv-aware", "round-robin", "least-loaded"]), default="kv-aware",
              show_default=True, help="The front door's routing policy.")
@click.option("--seed", default=0, show_default=True)
@click.option("--host-kv-memory", default="0", callback=_bytes,
              help="Host KV tier per worker (e.g. 4MiB); the report shows hits by tier.")
@click.option("--node-tier-memory", default="0", callback=_bytes,
              help="The manager's node tier both workers share (e.g. 8MiB); the report shows hits by level.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(num_requests: int, max_inflight: int, kv_blocks: int, tenants: int, policy: str, seed: int,
         host_kv_memory: int, node_tier_memory: int, as_json: bool) -> None:
    """A manager, two CPU workers and the HTTP front door serving a multi-tenant chat trace."""
    from kvpool.devcluster.demo import TextDemoConfig, format_report, run_text_demo
    from kvpool.devcluster.loadgen import ChatTraceConfig

    try:
        cfg = TextDemoConfig(ChatTraceConfig(num_requests=num_requests, num_tenants=tenants, seed=seed),
                             max_inflight=max_inflight, kv_blocks=kv_blocks, policy=policy,
                             host_kv_memory=host_kv_memory, node_tier_memory=node_tier_memory)
        result = run_text_demo(cfg, progress=not as_json)
    except (RuntimeError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("\ninterrupted: the demo's manager and workers are stopped", err=True)
        sys.exit(EXIT_INTERRUPTED)
    click.echo(json.dumps(result, indent=2, ensure_ascii=False) if as_json else format_report(result))
