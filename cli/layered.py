"""Service config for the daemons' commands: defaults < TOML file < KVPOOL_<SERVICE>_* < flags.

``kvpool manager``, ``kvpool worker``, ``kvpool serve`` (service ``frontdoor``) and ``kvpool config
show`` all build their config here, so
what ``config show`` prints is what the daemon would run with (flags aside).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import click
from click.core import ParameterSource

from kvpool.cli.common import log_options
from kvpool.shared.config import ConfigError, default_path, describe, load, parse_bytes

SECRET_FIELDS = ("admin_key", "api_key")  # printed masked by `config show`


def service_class(service: str) -> type:
    if service == "manager":
        from kvpool.manager.config import ManagerConfig

        return ManagerConfig
    if service == "frontdoor":
        from kvpool.frontend.serve_config import ServeConfig

        return ServeConfig
    from kvpool.worker.config import WorkerConfig

    return WorkerConfig


def explicit_flags(ctx: click.Context, service: str, rename: Mapping[str, str] | None = None) -> tuple[dict, dict]:
    """Options given on the command line or through their own envvar that name a config field:
    ({field: value}, {field: source label}). ``rename`` maps parameter names to field names."""
    rename = rename or {}
    fields = {f.name for f in dataclasses.fields(service_class(service))}
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for param in ctx.command.params:
        name = param.name
        src = ctx.get_parameter_source(name) if name else None
        if src not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        field = rename.get(name, name)
        if field not in fields:
            continue
        values[field] = ctx.params[name]
        envvar = getattr(param, "envvar", None)
        labels[field] = f"env {envvar}" if src is ParameterSource.ENVIRONMENT and isinstance(envvar, str) else "flag"
    return values, labels


def load_service(service: str, config_path: str | None, overrides: Mapping[str, Any] | None = None,
                 labels: Mapping[str, str] | None = None) -> tuple[Any, dict[str, str]]:
    """The effective config and each field's source; a ClickException says what to change."""
    path = config_path or default_path(service)
    try:
        return load(service_class(service), service, path, overrides=overrides, labels=labels)
    except ConfigError as e:
        raise click.ClickException(f"{service} config: {e}") from None


def rows(cfg: Any, source: Mapping[str, str]) -> list[dict]:
    out = []
    for name, value, src in describe(cfg, source):
        if name in SECRET_FIELDS and value is not None:
            value = "********"
        out.append({"field": name, "value": value, "source": src})
    return out


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    try:
        return None if value is None else parse_bytes(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def manager_ops_options(f: Callable) -> Callable:
    """`kvpool manager` options for metrics, KV events, CURVE and logs (None: config/default)."""
    opts = [
        click.option("--metrics-port", type=int, default=None, help="Prometheus /metrics TCP port; 0: off [0]."),
        click.option("--metrics-host", default=None, help="Address of the metrics endpoint [127.0.0.1]."),
        click.option("--events-endpoint", default=None, help="KV events PUB socket, e.g. tcp://*:5557 [off]."),
        click.option("--events-replay-endpoint", default=None, help="KV events replay socket, e.g. tcp://*:5558."),
        click.option("--vllm-events-endpoint", default=None,
                     help="Where attached vLLM servers publish their KV events (kvpool attach): the manager "
                          "binds it, their kv-events-config \"endpoint\" names it, e.g. tcp://127.0.0.1:5570 [off]."),
        click.option("--max-batch-ms", type=float, default=None,
                     help="An iteration stops reading after its messages took this long (0: only max_batch) [5]."),
        click.option("--events-format", default=None,
                     help="KV-event wire format, as the named vLLM release sends it: vllm-0.33 or vllm-0.11 "
                          "[vllm-0.33]."),
        click.option("--busy-poll-us", type=int, default=None,
                     help="After a busy iteration, poll without sleeping this many microseconds (adaptive: "
                          "off while the CPUs are contended); 0: always sleep [2000]."),
        click.option("--node-tier-memory", default=None, callback=_size,
                     help="Host memory of the node tier each KV layout gets, shared by every pool of the layout "
                          "(e.g. 4GiB) [0: none]."),
        click.option("--node-tier-dir", default=None, help="Where the node tier's shared-memory files go [/dev/shm]."),
        click.option("--node-tier-disk", default=None, help="The node tier's disk level: a directory [none]."),
        click.option("--node-tier-disk-size", default=None, callback=_size,
                     help="The disk level's byte budget per layout (e.g. 64GiB)."),
        click.option("--node-tier-policy", default=None,
                     type=click.Choice(["demote", "write_through", "write_through_selective"]),
                     help="When a block is written to the disk level: when host memory evicts it, with every "
                          "save, or at its second hit [demote]."),
        click.option("--node-tier-admit-hits", type=int, default=None,
                     help="Hits a block needs before it is written to disk [the policy's: 0, or 2 selective]."),
        click.option("--node-tier-pin-share", type=float, default=None,
                     help="At most this share of each level may be pinned (kvpool pin) [0.25]."),
        click.option("--curve-secret-key-file", default=None,
                     help="The manager's NAME.key_secret: CURVE on the control socket (`kvpool keygen`)."),
        click.option("--curve-allowed-keys-dir", default=None,
                     help="Directory of allowed clients' NAME.key files (SIGHUP re-reads it)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return log_options(f)


def summary(cfg: Any, source: Mapping[str, str]) -> str:
    """The values that are not defaults, with their sources, for the daemon's start-up log line."""
    given = [f"{r['field']}={r['value']!r} ({r['source']})" for r in rows(cfg, source) if r["source"] != "default"]
    return ", ".join(given) or "all defaults"
