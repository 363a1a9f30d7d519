"""`kvpool serve`: the OpenAI-compatible HTTP front door (frontend/)."""

from __future__ import annotations

import click

from kvpool.shared.protocol import default_endpoint


def _tokenizer_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple:
    pairs = []
    for v in values:
        model, sep, path = v.partition("=")
        if not sep or not model or not path:
            raise click.BadParameter(f"{v!r}: write MODEL=PATH (a directory with tokenizer.json)")
        pairs.append((model, path))
    return tuple(pairs)


@click.command("serve")
@click.option("--manager", "-m", "managers", multiple=True, envvar="KVPOOL_MANAGER",
              help="Manager endpoint; repeat for one manager per node (a comma list is one manager's "
                   "failover endpoints) [the local default]; env KVPOOL_MANAGER.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, help="TCP port (0: any free port).")
@click.option("--policy", type=click.Choice(["kv-aware", "round-robin", "least-loaded"]), default="kv-aware",
              show_default=True, help="Routing policy (frontend/router.py documents the cost function).")
@click.option("--kv-overlap-weight", default=2.0, show_default=True,
              help="KV-aware: weight of prompt blocks to compute against blocks already in use.")
@click.option("--tokenizer", "tokenizers", multiple=True, callback=_tokenizer_pairs,
              help="MODEL=PATH: the tokenizer for a model whose name is not a local checkpoint path.")
@click.option("--poll-interval", default=0.5, show_default=True, help="Seconds between worker-list refreshes.")
@click.option("--worker-silence", default=30.0, show_default=True,
              help="Seconds a worker may stay silent with requests open before they fail.")
@click.option("--log-level", default="warning", show_default=True)
def serve(managers: tuple[str, ...], host: str, port: int, policy: str, kv_overlap_weight: float,
          tokenizers: tuple, poll_interval: float, worker_silence: float, log_level: str) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) over the workers
    the managers know, routing each request to the worker holding its prefix."""
    from kvpool.frontend.server import FrontDoorServer
    from kvpool.frontend.service import FrontDoorConfig

    if not managers:
        managers = (default_endpoint(),)
    try:
        cfg = FrontDoorConfig(tuple(managers), policy, kv_overlap_weight, poll_interval, worker_silence, tokenizers)
        server = FrontDoorServer(cfg, host, port, log_level=log_level)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"kvpool front door on {server.url}/v1 ({policy}; managers {', '.join(managers)})")
    server.run()
