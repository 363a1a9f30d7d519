"""What every `kvpool` command shares: the exit-status table, options, the manager connection, output.

Exit status of every command (one table; the daemons' own codes included)::

    0   EXIT_OK            success
    1   EXIT_ERROR         the manager refused, bad input, an action failed (click.ClickException)
    2   EXIT_USAGE         a bad option or argument (click.UsageError)
    3   EXIT_UNREACHABLE   no manager (or worker, for `generate`) answered
    4   EXIT_UNHEALTHY     `kvpool status`: it answered but is unhealthy
    4   EXIT_TP_PEER_LOST  `kvpool worker`: another tensor-parallel rank of the pool is gone
    75  EXIT_FENCED        `kvpool manager`: another manager took the lease (manager/store/recovery.py)
    130 EXIT_INTERRUPTED   Ctrl-C (`generate` aborts its request on the worker, `demo` stops its processes)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from kvpool.shared.logs import LEVELS
from kvpool.shared.protocol import ManagerError, ManagerUnavailable, default_endpoint

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_UNHEALTHY = 4
EXIT_TP_PEER_LOST = 4
EXIT_INTERRUPTED = 130
EXIT_FENCED = 75  # the manager's own (kvpool.manager.store.recovery.EXIT_FENCED, checked by a test)
CURVE_META = "kvpool.curve"  # ctx.meta key: the ClientKeys from --curve-server-key/--curve-key-file


class Unreachable(click.ClickException):
    exit_code = EXIT_UNREACHABLE


def manager_option(f: Callable) -> Callable:
    return click.option(
        "--manager", "-m", "endpoint", envvar="KVPOOL_MANAGER", default=default_endpoint, show_default=True,
        help="Manager endpoint (ipc://PATH or tcp://HOST:PORT); env KVPOOL_MANAGER.",
    )(f)


def _curve_keys(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Stores the CURVE client keys in ctx.meta once both options are parsed."""
    ctx.meta.setdefault("kvpool.curve_args", {})[param.name] = value
    args = ctx.meta["kvpool.curve_args"]
    if len(args) == 2:
        from kvpool.shared.curve import ClientKeys

        try:
            ctx.meta[CURVE_META] = ClientKeys.load(args["curve_server_key"], args["curve_key_file"])
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def curve_options(f: Callable) -> Callable:
    f = click.option("--curve-key-file", envvar="KVPOOL_CURVE_KEY_FILE", default=None, expose_value=False,
                     callback=_curve_keys, help="This client's NAME.key_secret (CURVE); env KVPOOL_CURVE_KEY_FILE.")(f)
    return click.option("--curve-server-key", envvar="KVPOOL_CURVE_SERVER_KEY", default=None, expose_value=False,
                        callback=_curve_keys,
                        help="The manager's public key: its NAME.key file or Z85 text; env KVPOOL_CURVE_SERVER_KEY.")(f)


def export_curve_env(ctx: click.Context) -> None:
    """Puts the CURVE options into the environment, where ManagerClient (and child processes)
    read them when not given keys explicitly (shared/curve.py)."""
    from kvpool.shared.curve import ENV_KEY_FILE, ENV_SERVER_KEY

    args = ctx.meta.get("kvpool.curve_args", {})
    for var, name in ((ENV_SERVER_KEY, "curve_server_key"), (ENV_KEY_FILE, "curve_key_file")):
        if args.get(name):
            os.environ[var] = args[name]


ADMIN_KEY_FILE_META = "kvpool.admin_key_file"


def _admin_key_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    ctx.meta[ADMIN_KEY_FILE_META] = value
    return value


def client_options(f: Callable) -> Callable:
    f = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)
    f = click.option("--timeout", "timeout_s", default=3.0, show_default=True, help="Seconds to wait for a reply.")(f)
    f = click.option("--admin-key-file", envvar="KVPOOL_ADMIN_KEY_FILE", default=None, expose_value=False,
                     callback=_admin_key_file, type=click.Path(dir_okay=False),
                     help="Read the admin key from this file (mode 0600, first line); env KVPOOL_ADMIN_KEY_FILE.")(f)
    f = click.option("--admin-key", envvar="KVPOOL_ADMIN_KEY", default=None,
                     help="Admin key. On the command line every local user can read it (/proc/PID/cmdline): "
                          "prefer env KVPOOL_ADMIN_KEY or --admin-key-file.")(f)
    return curve_options(manager_option(f))


def _resolve_admin_key(ctx: click.Context | None, admin_key: str | None) -> str | None:
    path = ctx.meta.get(ADMIN_KEY_FILE_META) if ctx is not None else None
    if admin_key is not None or not path:
        return admin_key
    from kvpool.shared.bind import read_secret_file

    try:
        return read_secret_file(path, "--admin-key-file")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _check_socket_dir(endpoint: str) -> None:
    """The default ipc socket's directory must be this user's alone: a socket another user put
    there would receive the admin key."""
    from kvpool.shared.bind import check_private_dir, runtime_dir

    if not endpoint.startswith("ipc://"):
        return
    directory = os.path.dirname(endpoint[len("ipc://"):]) or "."
    if os.path.abspath(directory) == os.path.abspath(runtime_dir()) and os.path.exists(directory):
        try:
            check_private_dir(directory)
        except ValueError as e:
            raise click.ClickException(f"refusing to connect: {e}") from None


def _check_socket_exists(endpoint: str) -> None:
    """Unreachable at once when every endpoint is an ipc:// socket that does not exist: no manager
    listens there, and waiting out --timeout would only delay saying so."""
    paths = [ep[len("ipc://"):] for ep in endpoint.split(",")]
    if all(ep.startswith("ipc://") for ep in endpoint.split(",")) and not any(map(os.path.exists, paths)):
        where = paths[0] if len(paths) == 1 else ", ".join(paths)
        missing = "its directory does not exist" if not any(os.path.isdir(os.path.dirname(p) or ".") for p in paths) \
            else "no socket there"
        raise Unreachable(f"cannot reach the manager: {where}: {missing} (is `kvpool manager` running, on this "
                          "endpoint? pass --manager or set KVPOOL_MANAGER)")


@contextmanager
def connect(endpoint: str, timeout_s: float, admin_key: str | None) -> Iterator:
    from kvpool.client.manager import ManagerClient

    ctx = click.get_current_context(silent=True)
    curve = ctx.meta.get(CURVE_META) if ctx is not None else None
    admin_key = _resolve_admin_key(ctx, admin_key)
    _check_socket_dir(endpoint)
    _check_socket_exists(endpoint)
    # Without a key, an observer session: admin ops then work only on a manager without an admin key.
    role = "admin" if admin_key else "observer"
    try:
        client = ManagerClient(endpoint, role=role, identity="kvpool-cli", timeout_s=timeout_s,
                               admin_key=admin_key, curve=curve)
    except ValueError as e:  # bad CURVE settings in the environment
        raise click.ClickException(str(e)) from None
    try:
        yield client
        try:
            client.deregister()
        except ManagerError:
            pass
    except ManagerUnavailable as e:
        raise Unreachable(f"cannot reach the manager: {e.message}") from None
    except ManagerError as e:
        raise click.ClickException(f"the manager refused: {e.code}: {e.message}") from None
    finally:
        client.close()


def ask(endpoint: str, timeout_s: float, admin_key: str | None, op: str, **args: object) -> dict:
    with connect(endpoint, timeout_s, admin_key) as client:
        return client.call(op, **args)


def emit(data: object, as_json: bool, human: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        human()


def table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Prints ``rows`` under ``columns`` = [(header, key)], left-aligned, one space-padded."""
    if not rows:
        click.echo("(none)")
        return
    cells = [[_fmt(r.get(k)) for _, k in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(columns)]
    click.echo("  ".join(h.ljust(w) for (h, _), w in zip(columns, widths)).rstrip())
    for c in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


# -- daemon options ---------------------------------------------------------------------


def log_options(f: Callable) -> Callable:
    f = click.option("--log-level", type=click.Choice(LEVELS), default=None, help="Log level [info].")(f)
    return click.option("--json-logs/--plain-logs", "json_logs", default=None,
                        help="One JSON object per log line [plain].")(f)


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
    """--redis-url/--namespace, else the manager's config (--config, /etc/kvpool/manager.toml,
    KVPOOL_MANAGER_*; cli/state.py resolves it): never a silent default database."""
    f = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                     help="The manager's config file, for redis_url and namespace [/etc/kvpool/manager.toml "
                          "if it exists].")(f)
    f = click.option("--namespace", default=None, help="Redis key namespace [the manager config's, else default].")(f)
    return click.option("--redis-url", envvar="KVPOOL_REDIS_URL", default=None,
                        help="Redis URL; env KVPOOL_REDIS_URL [the manager config's redis_url; required "
                             "when it has none].")(f)
