"""State commands: `kvpool snapshot` and `kvpool restore`, and the manager's durability options.

    kvpool snapshot --redis-url URL --namespace NS -o state.kvps   # dump (verified) to a file
    kvpool snapshot --input state.kvps                               # inspect a file
    kvpool restore state.kvps --redis-url URL --namespace NS [--force] [--keep-state-id]

A snapshot file is the manager's own snapshot format (manager/store/state_file.py: magic, SHA-256,
msgpack): journal replayed, every invariant checked before it is written or restored.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable

import click


def durability_options(f: Callable) -> Callable:
    """`kvpool manager` options that persist its state in Redis (None: the config file's / default)."""
    opts = [
        click.option("--redis-url", envvar="KVPOOL_REDIS_URL", default=None,
                     help="Persist state in Redis: redis://HOST:PORT/DB, redis+sentinel://H:P[,H:P]/SERVICE, "
                          "redis+cluster://H:P[,H:P]; env KVPOOL_REDIS_URL."),
        click.option("--namespace", default=None, help="Redis key namespace: one state, one active manager [default]."),
        click.option("--durability", type=click.Choice(["sync", "async"]), default=None,
                     help="sync: commit before replying [default]; async: reply first (a crash may lose acks)."),
        click.option("--lease-ms", type=int, default=None,
                     help="Lease of the active manager; a standby takes over this long after it dies [3000]."),
        click.option("--snapshot-bytes", type=int, default=None, help="Journal bytes between snapshots [32 MiB]."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def redis_options(f: Callable) -> Callable:
    f = click.option("--namespace", default="default", show_default=True, help="Redis key namespace.")(f)
    return click.option("--redis-url", envvar="KVPOOL_REDIS_URL", default="redis://127.0.0.1:6379/0",
                        show_default=True, help="Redis URL; env KVPOOL_REDIS_URL.")(f)


def _registry():
    from kvpool.manager.registry import Registry

    return Registry("offline", session_timeout_s=10.0)


def summary(reg, seq: int) -> dict:
    pools = []
    for e in reg.pools.values():
        p = e.pool
        pools.append({"pool": e.name, "state": e.state, "epoch": e.epoch, "shards": len(e.shards),
                      "num_blocks": p.blocks.num_blocks if p else 0, "free_blocks": p.blocks.num_free if p else 0,
                      "cached_blocks": len(p.blocks.cached) if p else 0, "requests": len(p.requests) if p else 0})
    return {"state_id": reg.state_id, "seq": seq, "sessions": len(reg.sessions), "draining": reg.draining,
            "pools": pools}


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
def snapshot(redis_url: str, namespace: str, output: str | None, input_path: str | None, as_json: bool) -> None:
    """Dump a manager's state from Redis to a file (verified), or inspect a file."""
    from kvpool.manager.core.snapshot import CorruptState
    from kvpool.manager.store.state_file import (
        decode_state,
        dump_registry,
        encode_state,
        load_registry,
    )

    reg = _registry()
    try:
        if input_path:
            with open(input_path, "rb") as fh:
                seq = load_registry(decode_state(fh.read(), input_path), reg, time.monotonic())
            reg.check_invariants()
            what = input_path
        else:
            seq = _read(redis_url, namespace, reg)
            what = f"namespace {namespace}"
    except CorruptState as e:
        raise click.ClickException(f"corrupt state: {e}") from None
    except AssertionError as e:
        raise click.ClickException(f"corrupt state: an invariant is broken: {e}") from None
    if output:
        data = encode_state(dump_registry(reg, seq))
        tmp = f"{output}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # it holds every session's bearer sid: its owner's eyes only
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, output)  # never a half-written file under the final name
    info = summary(reg, seq)
    if output:
        info["output"], info["bytes"] = output, len(data)
    _print(info, as_json, what + (f" -> {output} ({len(data):,} bytes)" if output else ""))


def _read(redis_url: str, namespace: str, reg) -> int:
    import redis

    from kvpool.manager.store.offline import read_state
    from kvpool.manager.store.redis_url import connect

    try:
        client = connect(redis_url)
        try:
            return read_state(client, namespace, reg, time.monotonic())
        finally:
            client.close()
    except (redis.RedisError, ValueError) as e:
        raise click.ClickException(f"cannot read namespace {namespace!r} from {redis_url}: {e}") from None


@click.command("restore")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@redis_options
@click.option("--force", is_flag=True, help="Even while a manager holds the lease: it is fenced out and exits.")
@click.option("--keep-state-id", is_flag=True,
              help="Keep the file's state id (moving a stopped system): clients then carry on as if nothing "
                   "happened. Without it clients see a restart and recompute, which is always safe.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def restore(path: str, redis_url: str, namespace: str, force: bool, keep_state_id: bool, as_json: bool) -> None:
    """Replace a namespace's state in Redis by a snapshot file (verified first)."""
    import redis

    from kvpool.manager.core.snapshot import CorruptState
    from kvpool.manager.store.offline import write_state
    from kvpool.manager.store.redis_url import connect
    from kvpool.manager.store.state_file import (
        decode_state,
        dump_registry,
        encode_state,
        load_registry,
    )

    reg = _registry()
    try:
        with open(path, "rb") as fh:
            seq = load_registry(decode_state(fh.read(), path), reg, time.monotonic())
        reg.check_invariants()
    except (CorruptState, AssertionError) as e:
        raise click.ClickException(f"{path}: refusing a corrupt state: {e}") from None
    if not keep_state_id:
        reg.state_id = uuid.uuid4().hex
    try:
        client = connect(redis_url)
        try:
            write_state(client, namespace, encode_state(dump_registry(reg, seq)), seq, force)
        finally:
            client.close()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except redis.RedisError as e:
        raise click.ClickException(f"cannot write namespace {namespace!r} at {redis_url}: {e}") from None
    _print(summary(reg, seq), as_json, f"restored {path} into namespace {namespace}")
