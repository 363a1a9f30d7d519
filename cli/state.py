"""State commands: `kvpool snapshot` and `kvpool restore`, and the manager's durability options.

    kvpool snapshot --redis-url URL --namespace NS -o state.kvps   # dump (verified) to a file
    kvpool snapshot --input state.kvps                               # inspect a file
    kvpool restore state.kvps --redis-url URL --namespace NS [--force] [--keep-state-id]

A snapshot file is the manager's own snapshot format (manager/store/state_file.py: magic, SHA-256,
msgpack): journal replayed, every invariant checked before it is written or restored
(manager/snapshots.py does the reading and writing; this module is the command line).
"""

from __future__ import annotations

import json

import click

from kvpool.cli.common import redis_options
from kvpool.cli.layered import load_service


def resolve_redis(redis_url: str | None, namespace: str | None, config_path: str | None) -> tuple[str, str]:
    """The Redis URL and namespace given, else the manager config's; a URL is required."""
    if redis_url is None or namespace is None:
        try:
            cfg, _ = load_service("manager", config_path)
        except (ValueError, OSError) as e:
            raise click.ClickException(str(e)) from None
        redis_url = redis_url or cfg.redis_url
        namespace = namespace or cfg.namespace
    if not redis_url:
        raise click.UsageError("which Redis? pass --redis-url URL (or set redis_url in the manager's config, "
                               "or KVPOOL_REDIS_URL / KVPOOL_MANAGER_REDIS_URL)")
    return redis_url, namespace or "default"


def _print(info: dict, as_json: bool, what: str) -> None:
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    click.echo(f"{what}: state {info['state_id']} at batch {info['seq']}, {info['sessions']} sessions"
               f"{', draining' if info['draining'] else ''}; invariants hold")
    for p in info["pools"]:
        click.echo(f"  pool {p['pool']} ({p['state']}, epoch {p['epoch']}, {p['shards']} shards): "
                   f"{p['num_blocks']} blocks, {p['free_blocks']} free, {p['cached_blocks']} cached, "
                   f"{p['requests']} requests")


@click.command("snapshot")
@redis_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the state to this file (mode 0600: it holds every session's secret sid).")
@click.option("--input", "input_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Inspect a snapshot file instead of Redis.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def snapshot(redis_url: str | None, namespace: str | None, config_path: str | None, output: str | None,
             input_path: str | None, as_json: bool) -> None:
    """Dump a manager's state from Redis to a file (verified), or inspect a file. Which Redis:
    --redis-url, else the manager's config; never a guessed default."""
    from kvpool.manager.snapshots import (
        CorruptState,
        StateIOError,
        load_file,
        load_namespace,
        save_file,
        summary,
    )

    if not input_path:
        redis_url, namespace = resolve_redis(redis_url, namespace, config_path)
    try:
        reg, seq = load_file(input_path) if input_path else load_namespace(redis_url, namespace)
    except CorruptState as e:
        raise click.ClickException(f"corrupt state: {e}") from None
    except StateIOError as e:
        raise click.ClickException(str(e)) from None
    what = input_path or f"namespace {namespace}"
    info = summary(reg, seq)
    if output:
        info["output"], info["bytes"] = output, save_file(reg, seq, output)
        what += f" -> {output} ({info['bytes']:,} bytes)"
    _print(info, as_json, what)


@click.command("restore")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@redis_options
@click.option("--force", is_flag=True, help="Even while a manager holds the lease: it is fenced out and exits.")
@click.option("--keep-state-id", is_flag=True,
              help="Keep the file's state id (moving a stopped system): clients then carry on as if nothing "
                   "happened. Without it clients see a restart and recompute, which is always safe.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def restore(path: str, redis_url: str | None, namespace: str | None, config_path: str | None, force: bool,
            keep_state_id: bool, as_json: bool) -> None:
    """Replace a namespace's state in Redis by a snapshot file (verified first). Which Redis:
    --redis-url, else the manager's config; never a guessed default."""
    from kvpool.manager.snapshots import (
        CorruptState,
        StateIOError,
        load_file,
        restore_namespace,
        summary,
    )

    redis_url, namespace = resolve_redis(redis_url, namespace, config_path)
    try:
        reg, seq = load_file(path)
    except CorruptState as e:
        raise click.ClickException(f"{path}: refusing a corrupt state: {e}") from None
    try:
        restore_namespace(reg, seq, redis_url, namespace, force=force, keep_state_id=keep_state_id)
    except StateIOError as e:
        raise click.ClickException(str(e)) from None
    _print(summary(reg, seq), as_json, f"restored {path} into namespace {namespace}")
