"""Retention pins: `kvpool pin` keeps a prompt's prefix from eviction in a pool and its node tier
for a while, `kvpool pins` lists the pins, `kvpool unpin` ends one (manager/state/pins.py)."""

from __future__ import annotations

import json
import re
import time

import click

from kvpool.cli.common import ask, client_options, connect, emit, table

_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float:
    """'90', '90s', '15m', '1h', '2d' -> seconds."""
    m = _TTL.match(text)
    if m is None:
        raise click.BadParameter(f"cannot read a duration from {text!r}: write e.g. 900, 15m, 1h or 2d")
    return float(m.group(1)) * _UNIT[m.group(2) or "s"]


def prompt_ids(path: str, tokenizer: str | None) -> list[int]:
    """The prompt's token ids: a JSON list of ints or whitespace-separated ints, or with
    ``tokenizer`` (a checkpoint directory or a preset) the file's text, tokenized as the front
    door tokenizes it."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if tokenizer is not None:
        from kvpool.frontend.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer).encode(text)
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except ValueError:
        raise click.BadParameter(f"{path} holds neither token ids (a JSON list or whitespace-separated ints) "
                                 "nor is --tokenizer given to tokenize its text") from None
    if not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise click.BadParameter(f"{path}: the token ids must be a non-empty list of ints >= 0")
    return ids


@click.command("pin")
@click.option("--pool", "-p", required=True, help="Pool name.")
@click.option("--prompt-file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The prompt whose prefix to keep: token ids (JSON list or whitespace-separated), or text "
                   "with --tokenizer.")
@click.option("--ttl", required=True, help="How long, e.g. 900, 15m, 1h, 2d (at most 30 days).")
@click.option("--tokenizer", default=None, help="Tokenize the file's text as this model's (a checkpoint directory "
              "or a preset).")
@click.option("--cache-salt", default=None, help="The tenant's cache_salt, when its requests carry one.")
@client_options
def pin(pool: str, prompt_file: str, ttl: str, tokenizer: str | None, cache_salt: str | None, endpoint: str,
        timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Keep a prompt's prefix from eviction in the pool's device tier and its node tier for a while.

    Refused when the pins would take more than their share of a tier (node_tier_pin_share, 0.25):
    the message says how many blocks are pinned and how many may be.
    """
    from kvpool.shared.hashing import hash_blocks

    seconds = parse_ttl(ttl)
    ids = prompt_ids(prompt_file, tokenizer)
    with connect(endpoint, timeout_s, admin_key) as client:
        (row,) = [p for p in client.call("pools")["pools"] if p["pool"] == pool] or [None]
        if row is None:
            raise click.ClickException(f"no pool named {pool!r}")
        bs = row["block_size"]
        hashes = hash_blocks(ids[: len(ids) // bs * bs], bs, cache_salt=cache_salt)
        if not hashes:
            raise click.ClickException(f"the prompt has {len(ids)} tokens: no full block of {bs} to pin")
        body = client.call("pin", pool=pool, hashes=hashes, ttl_s=seconds)
    emit(body, as_json, lambda: click.echo(
        f"pin {body['pin_id']}: {body['num_hashes']} blocks of pool {pool} for {seconds:.0f}s "
        f"({body['device_blocks']} held in its device tier now{', and its node tier' if body['node'] else ''})"))


@click.command("pins")
@client_options
def pins(endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """List the retention pins, with the time each has left."""
    body = ask(endpoint, timeout_s, admin_key, "pins")
    rows = [{**p, "until": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p["expires_at"])),
             "left": f"{p['remaining_s']:.0f}s"} for p in body["pins"]]
    emit(body, as_json, lambda: table(rows, [("PIN", "pin_id"), ("POOL", "pool"), ("BLOCKS", "num_hashes"),
                                             ("DEVICE", "device_blocks"), ("NODE", "node"), ("UNTIL", "until"),
                                             ("LEFT", "left")]))


@click.command("unpin")
@click.argument("pin_id", type=click.IntRange(min=1))
@client_options
def unpin(pin_id: int, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """End a retention pin: its blocks are evictable again."""
    body = ask(endpoint, timeout_s, admin_key, "unpin", pin_id=pin_id)
    emit(body, as_json, lambda: click.echo(f"pin {pin_id} ended"))
