"""External pools: `kvpool attach` a running vLLM server, `kvpool detach` it, `kvpool externals`
lists them with the state of their KV-event mirrors (manager/external/)."""

from __future__ import annotations

import click

from kvpool.cli.common import ask, client_options, emit, table


@click.command("attach")
@click.argument("name")
@click.option("--url", required=True, help="The server's OpenAI base URL, e.g. http://127.0.0.1:8000.")
@click.option("--model", "model", required=True, help="The model id it serves (its --served-model-name).")
@click.option("--block-size", required=True, type=click.IntRange(1, 1 << 16), help="Its --block-size.")
@click.option("--topic", required=True,
              help="The topic of its KV events (kv-events-config \"topic\"): one per server.")
@click.option("--events", "events_ep", default=None,
              help="Its event PUB endpoint when it binds one (ipc://, or tcp://HOST:PORT for tcp://*:PORT); "
                   "a server given the manager's vllm_events_endpoint needs none.")
@click.option("--replay", "replay_ep", default=None, help="Its replay endpoint (kv-events-config \"replay_endpoint\").")
@client_options
def attach(name: str, url: str, model: str, block_size: int, topic: str, events_ep: str | None,
           replay_ep: str | None, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Mirror a vLLM server's KV cache from its events (routing by prefix, as for kvpool's pools)."""
    body = ask(endpoint, timeout_s, admin_key, "attach", name=name, url=url, model=model, block_size=block_size,
               topic=topic, events=events_ep, replay=replay_ep)

    def human() -> None:
        where = body["events_endpoint"] or events_ep or "(no events endpoint: set vllm_events_endpoint or --events)"
        click.echo(f"attached {name}: {url} (model {model}); its events: topic {topic!r} at {where}")
    emit(body, as_json, human)


@click.command("detach")
@click.argument("name")
@client_options
def detach(name: str, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Stop mirroring an attached server."""
    body = ask(endpoint, timeout_s, admin_key, "detach", name=name)
    emit(body, as_json, lambda: click.echo(f"detached {name}"))


@click.command("externals")
@client_options
def externals(endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Attached servers: their mirrors' blocks, batches, gaps, replays and staleness."""
    rows = ask(endpoint, timeout_s, admin_key, "externals")["externals"]
    for r in rows:
        human_row(r)
    cols = [("NAME", "name"), ("MODEL", "model"), ("URL", "url"), ("BLOCKS", "device_blocks"),
            ("BATCHES", "applied"), ("GAPS", "gaps"), ("REPLAYS", "replays"), ("LOST", "lost"),
            ("RUNNING", "running"), ("WAITING", "waiting"), ("KV_USAGE", "kv"), ("HEALTH", "health")]
    emit(rows, as_json, lambda: table(rows, cols))


def human_row(r: dict) -> dict:
    """An ``externals`` row's table cells: device blocks, health, the server's own load."""
    r["device_blocks"] = r.get("blocks", {}).get("GPU", 0)
    r["health"] = "ok" if r.get("stale") is None else f"stale: {r['stale']}"
    if r.get("http"):
        r["health"] += f"; /metrics: {r['http']}"
    r.setdefault("running", "-")
    r.setdefault("waiting", "-")
    r["kv"] = f"{r['kv_usage']:.0%}" if isinstance(r.get("kv_usage"), (int, float)) else "-"
    return r
