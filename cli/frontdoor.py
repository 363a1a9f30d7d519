"""`kvpool serve`: the OpenAI-compatible HTTP front door (frontend/); its settings are layered
as the daemons' are (frontend/serve_config.py)."""

from __future__ import annotations

import click


def _tokenizer_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple:
    pairs = []
    for v in values:
        model, sep, path = v.partition("=")
        if not sep or not model or not path:
            raise click.BadParameter(f"{v!r}: write MODEL=PATH (a directory with tokenizer.json)")
        pairs.append((model, path))
    return tuple(pairs)


@click.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Config file (.toml with a [frontdoor] table) [/etc/kvpool/frontdoor.toml if it exists]; "
                   "KVPOOL_FRONTDOOR_<FIELD> environment variables override it, options given here override both.")
@click.option("--manager", "-m", "managers", multiple=True, envvar="KVPOOL_MANAGER",
              help="Manager endpoint; repeat for one manager per node (a comma list is one manager's "
                   "failover endpoints) [the local default]; env KVPOOL_MANAGER. In "
                   "KVPOOL_FRONTDOOR_MANAGERS ';' separates managers and commas one manager's failover "
                   "endpoints ('tcp://a:5555;tcp://b:5555', 'tcp://a:5555,tcp://a2:5555;'): a comma "
                   "without a ';' is refused as ambiguous.")
@click.option("--host", default=None, help="HTTP address to listen on [127.0.0.1].")
@click.option("--port", type=int, default=None, help="HTTP TCP port (0: any free port) [8000].")
@click.option("--policy", type=click.Choice(["kv-aware", "round-robin", "least-loaded"]), default=None,
              help="Routing policy (frontend/router.py documents the cost function) [kv-aware].")
@click.option("--kv-overlap-weight", type=float, default=None,
              help="KV-aware: weight of prompt blocks to compute against blocks already in use [2.0].")
@click.option("--tokenizer", "tokenizers", multiple=True, callback=_tokenizer_pairs,
              help="MODEL=PATH: the tokenizer for a model whose name is not a local checkpoint path.")
@click.option("--poll-interval", type=float, default=None, help="Seconds between worker-list refreshes [0.5].")
@click.option("--worker-silence", type=float, default=None,
              help="Seconds a worker, or one request on it, may stay silent before its requests fail [30]; "
                   "workers send a heartbeat every second.")
@click.option("--manager-grace", type=float, default=None,
              help="Seconds a manager may fail the worker-list polls, or workers report it unreachable, before "
                   "new requests to its workers get 503 manager_unreachable [5].")
@click.option("--log-level", default=None, help="uvicorn's log level [warning].")
@click.option("--curve-server-key", envvar="KVPOOL_CURVE_SERVER_KEY", default=None,
              help="The managers' public key (NAME.key or Z85 text) when they run CURVE; env KVPOOL_CURVE_SERVER_KEY.")
@click.option("--curve-key-file", envvar="KVPOOL_CURVE_KEY_FILE", default=None,
              help="This front door's NAME.key_secret (`kvpool keygen`), for managers and workers that run "
                   "CURVE; env KVPOOL_CURVE_KEY_FILE.")
@click.option("--worker-curve-key", envvar="KVPOOL_WORKER_CURVE_KEY", default=None,
              help="The workers' public key (NAME.key or Z85 text) when their generate sockets run CURVE; "
                   "env KVPOOL_WORKER_CURVE_KEY.")
@click.option("--insecure", is_flag=True, default=None,
              help="Connect to managers and workers on non-loopback TCP without CURVE (a trusted, isolated "
                   "network only).")
@click.option("--api-key", envvar="KVPOOL_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 (as vllm serve --api-key); env KVPOOL_API_KEY.")
@click.option("--api-key-file", default=None, help="A file (mode 0600) whose first line is an API key; with --api-key both are accepted.")
@click.option("--allow-unauthenticated", is_flag=True, default=None,
              help="Listen beyond loopback with no API key (a trusted, isolated network only).")
@click.option("--max-connections", type=int, default=None, help="Open HTTP connections; more are closed [4096].")
@click.option("--limit-concurrency", type=int, default=None, help="Requests in progress; more get a 503 [2048].")
@click.option("--header-timeout", type=float, default=None,
              help="Seconds for a request's line and headers to arrive, else the connection closes [10].")
@click.option("--body-timeout", type=float, default=None, help="Seconds for a request's body to arrive (408) [30].")
@click.option("--keep-alive-timeout", type=float, default=None, help="Idle seconds between requests of a connection [5].")
@click.pass_context
def serve(ctx: click.Context, config_path: str | None, **_: object) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) over the workers
    the managers know, routing each request to the worker holding its prefix."""
    from kvpool.cli.layered import explicit_flags, load_service
    from kvpool.frontend.server import FrontDoorServer

    flags, labels = explicit_flags(ctx, "frontdoor")
    cfg, _source = load_service("frontdoor", config_path, flags, labels)
    try:
        fd_cfg = cfg.frontdoor_config()
        server = FrontDoorServer(fd_cfg, cfg.host, cfg.port, log_level=cfg.log_level, limits=cfg.http_limits(),
                                 api_keys=cfg.api_keys())
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"kvpool front door on {server.url}/v1 ({cfg.policy}; managers {', '.join(fd_cfg.managers)})")
    server.run()
