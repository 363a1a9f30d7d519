"""Operator tools: `kvpool config show`, `kvpool events`, `kvpool keygen`."""

from __future__ import annotations

import json
import time

import click

from kvpool.cli.common import emit, table
from kvpool.cli.layered import load_service, rows
from kvpool.shared.protocol import default_endpoint


@click.group("config")
def config() -> None:
    """Service configuration (defaults < TOML file < KVPOOL_<SERVICE>_* env < flags)."""


@config.command("show")
@click.argument("service", type=click.Choice(["manager", "worker", "frontdoor"]))
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Config file [/etc/kvpool/SERVICE.toml if it exists].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def config_show(service: str, config_path: str | None, as_json: bool) -> None:
    """Print the effective config of SERVICE and where each value came from.

    Flags of the daemon's own command line are not known here; everything else (defaults, the
    file, KVPOOL_MANAGER_* / KVPOOL_WORKER_* / KVPOOL_FRONTDOOR_* variables) is. Invalid values fail as
    the daemon would (``frontdoor``: `kvpool serve`).
    """
    cfg, source = load_service(service, config_path)
    out = rows(cfg, source)
    shown = [{**r, "value": "-" if r["value"] is None else str(r["value"])} for r in out]
    emit(out, as_json, lambda: table(shown, [("FIELD", "field"), ("VALUE", "value"), ("SOURCE", "source")]))


# -- KV events -----------------------------------------------------------------------------


def _hex(v: object) -> object:
    """Bytes as hex, inside lists and maps (JSON output)."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [_hex(x) for x in v]
    if isinstance(v, dict):
        return {k: _hex(x) for k, x in v.items()}
    return v


def _summary(events: list[dict]) -> str:
    parts = []
    for ev in events:
        hashes = ev.get("block_hashes") or [b""]
        first = hashes[0].hex()[:8] if isinstance(hashes[0], bytes) else str(hashes[0])
        if ev["type"] == "BlockStored":
            parent = ev.get("parent_block_hash")
            parent = "-" if parent is None else parent.hex()[:8] if isinstance(parent, bytes) else str(parent)
            parts.append(f"stored {len(hashes)} [{first}..] parent {parent}")
        elif ev["type"] == "BlockRemoved":
            parts.append(f"removed {len(hashes)} [{first}..]")
        else:
            parts.append(str(ev["type"]))
    return ", ".join(parts)


def _print_batch(batch, as_json: bool) -> None:
    if batch.error is not None:
        click.echo(f"#{batch.seq} {batch.topic}: undecodable batch ({batch.error})", err=True)
    elif as_json:
        click.echo(json.dumps({"pool": batch.topic, "seq": batch.seq, "ts": batch.ts, "format": batch.format,
                               "events": _hex(batch.events)}))
    else:
        stamp = time.strftime("%H:%M:%S", time.localtime(batch.ts))
        click.echo(f"{stamp} #{batch.seq} {batch.topic} [{batch.format}]: {_summary(batch.events)}")


def _events_endpoints(manager_ep: str, endpoint: str | None, replay: str | None) -> tuple[str, str | None]:
    """The endpoints to tail: as given, else the manager's (its `stats` says where it publishes).
    A manager that publishes nothing is an error at once, not a silent wait."""
    from kvpool.cli.common import Unreachable, ask

    if endpoint is not None:  # the operator said where: subscribe at once, ask nobody
        return endpoint, replay
    try:
        m = ask(manager_ep, 2.0, None, "stats")["manager"]
    except Unreachable as e:
        raise Unreachable(f"{e.message}; to tail a publisher without asking its manager, pass --endpoint") from None
    if "events_endpoint" not in m:  # a manager from before it said so
        raise click.ClickException(f"the manager at {manager_ep} does not say where it publishes KV events; "
                                   "pass --endpoint")
    if not m["events_endpoint"]:
        raise click.ClickException(
            f"the manager at {manager_ep} publishes no KV events: start it with --events-endpoint "
            "(e.g. tcp://127.0.0.1:5557; events_endpoint in its config), or point -m at the manager you mean")
    return _connectable(m["events_endpoint"]), replay or _connectable(m.get("events_replay_endpoint"))


def _connectable(endpoint: str | None) -> str | None:
    """A bound endpoint as a local client connects to it (tcp://*:P and tcp://0.0.0.0:P: loopback)."""
    if endpoint and endpoint.startswith(("tcp://*:", "tcp://0.0.0.0:")):
        return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return endpoint


@click.command("events")
@click.option("--manager", "-m", "manager_ep", envvar="KVPOOL_MANAGER", default=default_endpoint, show_default=True,
              help="The manager whose events to tail (it says where it publishes them); env KVPOOL_MANAGER.")
@click.option("--endpoint", "-e", envvar="KVPOOL_EVENTS", default=None,
              help="The events PUB endpoint [the manager's events_endpoint]; env KVPOOL_EVENTS.")
@click.option("--replay-endpoint", envvar="KVPOOL_EVENTS_REPLAY", default=None,
              help="The replay endpoint (needed by --replay-from) [the manager's]; env KVPOOL_EVENTS_REPLAY.")
@click.option("--replay-from", type=int, default=None, help="First print the buffered batches from this sequence number.")
@click.option("--pool", "-p", "pools", multiple=True, help="Only these pools (topics); repeatable.")
@click.option("--count", type=int, default=None, help="Stop after this many batches.")
@click.option("--timeout", "timeout_s", type=float, default=5.0, show_default=True, help="Replay answer timeout.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per batch, hashes in hex.")
def events(manager_ep: str, endpoint: str | None, replay_endpoint: str | None, replay_from: int | None,
           pools: tuple[str, ...], count: int | None, timeout_s: float, as_json: bool) -> None:
    """Tail the manager's KV events (BlockStored / BlockRemoved / AllBlocksCleared batches).

    The manager is asked first where it publishes; one that publishes none is reported at once.
    Decodes both formats the manager can send (events_format): vllm-0.33, vLLM 0.33.0's tagged
    maps, and vllm-0.11, vLLM 0.11.0's arrays; each batch shows the format it came in."""
    from kvpool.manager.event_client import EventTail

    endpoint, replay_endpoint = _events_endpoints(manager_ep, endpoint, replay_endpoint)
    if replay_from is not None and not replay_endpoint:
        raise click.UsageError("--replay-from needs --replay-endpoint")
    tail = EventTail(endpoint, pools)  # subscribed before the replay, so no batch falls between the two
    printed, last = 0, -1
    try:
        if replay_from is not None:
            try:
                replayed = tail.replay(replay_endpoint, replay_from, timeout_s)  # type: ignore[arg-type]
            except TimeoutError as e:
                raise click.ClickException(str(e)) from None
            for batch in replayed:
                _print_batch(batch, as_json)
                printed, last = printed + 1, batch.seq
                if count is not None and printed >= count:
                    return
        while count is None or printed < count:
            batch = tail.next()
            if batch.seq <= last:
                continue  # already printed from the replay
            _print_batch(batch, as_json)
            printed, last = printed + 1, batch.seq
    except KeyboardInterrupt:
        pass
    finally:
        tail.close()


# -- CURVE keys ----------------------------------------------------------------------------


@click.command("keygen")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Directory to write to (the current directory by default).")
@click.option("--name", default="kvpool", show_default=True, help="Key name: NAME.key and NAME.key_secret.")
@click.option("--force", is_flag=True, help="Overwrite an existing keypair of that name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def keygen(out_dir: str, name: str, force: bool, as_json: bool) -> None:
    """Write a CURVE keypair: NAME.key (public, share it) and NAME.key_secret (mode 0600).

    The manager: curve_secret_key_file = its NAME.key_secret. Each client: copy its NAME.key into
    the manager's curve_allowed_keys_dir (then SIGHUP the manager), and run with
    --curve-key-file NAME.key_secret --curve-server-key MANAGER.key.
    """
    from kvpool.shared.curve import read_keypair, write_keypair

    try:
        public_path, secret_path = write_keypair(out_dir, name, force=force)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    public = read_keypair(str(secret_path))[0].decode()
    info = {"public_key": public, "public_file": str(public_path), "secret_file": str(secret_path)}
    emit(info, as_json, lambda: click.echo(f"public key {public}\n  {public_path}\n  {secret_path} (secret, 0600)"))
