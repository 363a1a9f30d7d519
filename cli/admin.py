"""Manager commands: `kvpool manager` runs the daemon; the others ask it (tables, or --json).

Exit status: cli/common.py's table (0 ok, 1 refused, 3 unreachable, 4 unhealthy for `status`).
"""

from __future__ import annotations

import json
import logging
import time

import click

from kvpool.cli.common import (
    EXIT_UNHEALTHY,
    Unreachable,
    ask,
    client_options,
    connect,
    durability_options,
    emit,
    table,
)
from kvpool.cli.external import human_row
from kvpool.cli.layered import explicit_flags, load_service, manager_ops_options, summary
from kvpool.cli.node_view import hits_by_level, print_node_tiers
from kvpool.client.retry import RetryPolicy
from kvpool.shared.summaries import PoolSummary

DRAIN_POLL = RetryPolicy(first_pause_s=0.2, max_pause_s=0.2)  # `drain --wait`: asked every 0.2 s

# -- the daemon ----------------------------------------------------------------------------


@click.command("manager")
@click.option("--manager", "-m", "endpoint", envvar="KVPOOL_MANAGER", default=None,
              help="Endpoint to bind (ipc://PATH or tcp://HOST:PORT); env KVPOOL_MANAGER "
                   "[ipc://$XDG_RUNTIME_DIR/kvpool/manager.sock].")
@click.option("--session-timeout", "session_timeout_s", type=float, default=None,
              help="Seconds of silence after which a session is dead and its requests freed [10].")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Config file (.toml with a [manager] table, or .json) [/etc/kvpool/manager.toml if it "
                   "exists]; KVPOOL_MANAGER_<FIELD> environment variables override it, options override both.")
@click.option("--admin-key", envvar="KVPOOL_ADMIN_KEY", default=None,
              help="Require this key for admin ops. On the command line every local user can read it "
                   "(/proc/PID/cmdline): prefer env KVPOOL_ADMIN_KEY or --admin-key-file.")
@click.option("--admin-key-file", envvar="KVPOOL_MANAGER_ADMIN_KEY_FILE", default=None,
              type=click.Path(dir_okay=False), help="Read the admin key from this file (mode 0600, first line).")
@click.option("--insecure", is_flag=True, default=None,
              help="Allow binding a non-loopback TCP address without CURVE (a trusted, isolated network only).")
@durability_options
@manager_ops_options
@click.pass_context
def manager(ctx: click.Context, config_path: str | None, **_: object) -> None:
    """Run the manager daemon (SIGTERM stops it cleanly; SIGHUP re-reads the allowed CURVE keys).

    `kvpool config show manager` prints the effective config and where each value came from.
    """
    from kvpool.manager.daemon import serve
    from kvpool.shared.logs import setup_logging

    cfg, source = load_service("manager", config_path, *explicit_flags(ctx, "manager"))
    setup_logging(cfg.log_level, cfg.json_logs)
    logging.getLogger(__name__).info("config: %s", summary(cfg, source))
    try:
        rc = serve(cfg)
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    ctx.exit(rc)


# -- queries -------------------------------------------------------------------------------


@click.command("status")
@click.option("--pool", "-p", "required", multiple=True,
              help="Also require this pool to exist and be ready (a worker's healthcheck); repeatable.")
@client_options
@click.pass_context
def status(ctx: click.Context, required: tuple[str, ...], endpoint: str, timeout_s: float, admin_key: str | None,
           as_json: bool) -> None:
    """Is the manager up and healthy? Its incarnation, uptime, sessions, pools and traffic.

    Healthy means: it answers within --timeout, is not draining, every pool it knows is either
    served (all shards registered, each by a live worker session) or idle (its workers all
    stopped cleanly), every --pool exists and is served by live workers, and its state store
    reports no error. A worker that died is seen once its session times out (the manager's
    session_timeout_s). Exit status: 0 healthy, 4 unhealthy (the reasons are printed), 3
    unreachable, 1 refused (e.g. a standby, or a manager that lost its state store). Use it as a
    healthcheck; a worker's healthcheck adds --pool with its own pool.
    """
    try:
        body = ask(endpoint, timeout_s, admin_key, "stats")
    except Unreachable as e:
        if as_json:  # a script reading the JSON gets an answer, not an empty output
            emit({"reachable": False, "healthy": False, "problems": [e.message]}, True, lambda: None)
        raise
    m = body["manager"]
    problems = health_problems(body, required)

    def human() -> None:
        click.echo(f"manager {endpoint}: up {m['uptime_s']:.0f}s, incarnation {m['incarnation']}, "
                   f"protocol v{m['version']}{', DRAINING' if m['draining'] else ''}")
        click.echo(f"  {m['sessions']} sessions, {m['pools']} pools, {m['requests']} requests")
        errors = sum(m["errors"].values())
        click.echo(f"  {m['messages']} messages, {errors} errors, {m['dropped']} dropped, "
                   f"step p50 <= {m['step_latency']['p50'] * 1e6:.0f}us p99 <= {m['step_latency']['p99'] * 1e6:.0f}us")
        click.echo("  healthy" if not problems else "  UNHEALTHY: " + "; ".join(problems))

    emit({**m, "reachable": True, "healthy": not problems, "problems": problems}, as_json, human)
    if problems:
        ctx.exit(EXIT_UNHEALTHY)


def health_problems(stats_body: dict, required: tuple[str, ...] = ()) -> list[str]:
    """Why a manager's ``stats`` reply is unhealthy (empty: healthy)."""
    m, problems = stats_body["manager"], []
    if m.get("draining"):
        problems.append("draining (kvpool drain --cancel ends it)")
    pools = stats_body.get("pools", {})
    health = {name: p.get("health", "ok" if p.get("state") == "ready" else "waiting") for name, p in pools.items()}
    waiting = sorted(name for name, h in health.items() if h == "waiting")
    if waiting:
        problems.append(f"pools waiting for shards: {', '.join(waiting[:10])}")
    lost = sorted(name for name, h in health.items() if h == "lost")
    if lost:
        problems.append(f"pools whose worker died (session expired): {', '.join(lost[:10])}; restart the "
                        "worker, or forget the pool with `kvpool drop-pool NAME`")
    missing = [name for name in required if name not in pools]
    if missing:
        problems.append(f"no pool {', '.join(missing)} (its worker has not registered)")
    idle = [name for name in required if health.get(name) == "idle"]
    if idle:
        problems.append(f"pool {', '.join(idle)} has no live worker (its workers stopped)")
    store = stats_body.get("store") or {}
    if store.get("healthy") is False or store.get("error"):
        problems.append(f"state store error: {store.get('error') or 'unhealthy'}")
    return problems


@click.command("pools")
@client_options
def pools(endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Pools with their epoch, shards and block usage."""
    body = ask(endpoint, timeout_s, admin_key, "pools")
    rows, externals = body["pools"], body.get("externals", [])
    for r in rows:
        summary = PoolSummary.from_wire(r)
        r["shards_up"] = f"{summary.registered}/{summary.shard_count}"
        r["live_up"] = f"{r.get('live_shards', 0)}/{summary.shard_count}"
    cols = [("POOL", "pool"), ("STATE", "state"), ("HEALTH", "health"), ("EPOCH", "epoch"),
            ("SHARDS", "shards_up"), ("LIVE", "live_up"),
            ("BLOCKS", "num_blocks"), ("FREE", "free_blocks"), ("CACHED", "cached_blocks"),
            ("REQUESTS", "requests"), ("BLOCK_SIZE", "block_size")]
    if any("host_num_blocks" in r for r in rows):  # a host tier somewhere: its size, hashes and policy
        for r in rows:
            tier = "host_num_blocks" in r
            r["host"] = f"{r['host_cached_blocks']}/{r['host_num_blocks']}" if tier else "-"
            r["host_policy"] = r.get("host_policy", "-") if tier else "-"
        cols[7:7] = [("HOST_CACHED", "host"), ("HOST_POLICY", "host_policy")]
    if any("node_layout" in r for r in rows):  # a node tier: the layout it shares, each level's cached/slots
        for r in rows:
            r["node"] = r.get("node_layout") or "-"
            r["node_levels"] = " ".join(f"{lv} {r[f'node_{lv}'][0]}/{r[f'node_{lv}'][1]}" for lv in ("host", "disk")
                                        if f"node_{lv}" in r) or "-"
        cols += [("NODE_TIER", "node"), ("NODE_CACHED", "node_levels")]

    def human() -> None:
        table(rows, cols)
        if externals:  # attached vLLM servers (kvpool externals has the rest)
            click.echo()
            table([human_row(r) for r in externals],
                  [("EXTERNAL", "name"), ("MODEL", "model"), ("BLOCKS", "device_blocks"), ("RUNNING", "running"),
                   ("WAITING", "waiting"), ("KV_USAGE", "kv"), ("HEALTH", "health")])
    emit(rows, as_json, human)  # (--json: the pools; `kvpool externals --json` has the servers)


@click.command("sessions")
@client_options
def sessions(endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Connected clients (this command's own session included)."""
    rows = ask(endpoint, timeout_s, admin_key, "sessions")["sessions"]
    cols = [("SESSION", "session"), ("IDENTITY", "identity"), ("ROLE", "role"), ("AGE_S", "age_s"),
            ("IDLE_S", "idle_s"), ("REQUESTS", "requests")]
    emit(rows, as_json, lambda: table(rows, cols))


@click.command("requests")
@click.option("--pool", "-p", required=True, help="Pool name.")
@click.option("--limit", default=1000, show_default=True, help="At most this many rows.")
@client_options
def requests(pool: str, limit: int, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Requests holding blocks in one pool."""
    body = ask(endpoint, timeout_s, admin_key, "requests", pool=pool, limit=limit)
    cols = [("SESSION", "session"), ("IDENTITY", "identity"), ("REQ", "req"), ("TOKENS", "num_tokens"),
            ("BLOCKS", "blocks"), ("CACHED_BLOCKS", "cached_blocks")]

    def human() -> None:
        click.echo(f"pool {body['pool']} epoch {body['epoch']}: {body['total']} requests")
        table(body["requests"], cols)

    emit(body, as_json, human)


def _print_stats(body: dict) -> None:
    m = body["manager"]
    click.echo(f"manager: {m['sessions']} sessions, {m['requests']} requests, {m['messages']} messages, "
               f"{m['sub_ops']} sub-ops, errors {m['errors'] or 0}, dropped {m['dropped']}")
    rows = [{"pool": name, **p} for name, p in body["pools"].items()]
    for r in rows:
        r["usage"] = f"{r.get('usage', 0):.1%}"
        r["hit_rate"] = f"{r.get('prefix_hit_rate', 0):.1%}"
    cols = [("POOL", "pool"), ("EPOCH", "epoch"), ("USAGE", "usage"), ("HIT_RATE", "hit_rate"),
            ("REQUESTS", "requests"), ("ALLOCS", "allocations"), ("NO_SPACE", "no_space"),
            ("EVICTIONS", "evictions"), ("FORKS", "forks")]
    if any("host_hit_tokens" in r or "node_hit_tokens" in r for r in rows):
        for r in rows:
            r["by_level"] = hits_by_level(r)
        cols.append(("HITS device/host/node-host/node-disk", "by_level"))
    table(rows, cols)
    print_node_tiers(m.get("node_tiers") or {})


@click.command("stats")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes with --watch.")
@client_options
def stats(watch: bool, interval: float, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Manager counters and per-pool usage, hit rate, allocations, evictions."""
    if not watch:
        body = ask(endpoint, timeout_s, admin_key, "stats")
        emit(body, as_json, lambda: _print_stats(body))
        return
    with connect(endpoint, timeout_s, admin_key) as client:
        try:
            while True:
                body = client.call("stats")
                if as_json:
                    click.echo(json.dumps(body, sort_keys=True), nl=True)
                else:
                    click.clear()
                    click.echo(f"{time.strftime('%H:%M:%S')}  {endpoint}  (Ctrl-C to stop)")
                    _print_stats(body)
                time.sleep(interval)
        except KeyboardInterrupt:
            pass


# -- actions -------------------------------------------------------------------------------


_TIER = click.option("--tier", type=click.Choice(["device", "host", "node-host", "node-disk"]), default="device",
                     show_default=True,
                     help="Which tier of the pool: the device blocks, the host tier (--host-kv-memory), or a level "
                          "of the node tier it shares with every pool of its layout (manager --node-tier-memory).")


def _tier_arg(tier: str) -> dict:
    return {"tier": tier.replace("-", "_")} if tier != "device" else {}  # the device tier: the request as before


@click.command("reset-cache")
@click.option("--pool", "-p", required=True, help="Pool name.")
@_TIER
@client_options
def reset_cache(pool: str, tier: str, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Forget every cached block hash of a pool's tier (refused while blocks are in use)."""
    body = ask(endpoint, timeout_s, admin_key, "reset_cache", pool=pool, **_tier_arg(tier))
    emit(body, as_json, lambda: click.echo(f"pool {pool}: {tier} prefix cache reset"))


@click.command("evict")
@click.option("--pool", "-p", required=True, help="Pool name.")
@click.option("--blocks", "-n", "num", type=click.IntRange(min=0), required=True,
              help="Drop the hashes of up to this many free cached blocks (least recently used first).")
@_TIER
@client_options
def evict(pool: str, num: int, tier: str, endpoint: str, timeout_s: float, admin_key: str | None,
          as_json: bool) -> None:
    """Evict free cached blocks of a pool's tier (their hashes are forgotten; blocks in use stay).

    With a host tier, --tier device drops the blocks' hashes without saving them to the host tier:
    a save can only be ordered inside a step (docs/operating.md, "The host tier"). Use --tier host
    to empty the host tier as well.
    """
    body = ask(endpoint, timeout_s, admin_key, "evict", pool=pool, n=num, **_tier_arg(tier))
    emit(body, as_json, lambda: click.echo(f"pool {pool}: {body['evicted']} cached blocks evicted ({tier} tier)"))


@click.command("drain")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until every request is freed.")
@click.option("--wait-timeout", default=600.0, show_default=True, help="Give up waiting after this many seconds.")
@click.option("--cancel", is_flag=True, help="Accept new allocations again.")
@client_options
def drain(wait: bool, wait_timeout: float, cancel: bool, endpoint: str, timeout_s: float, admin_key: str | None,
          as_json: bool) -> None:
    """Refuse new allocations; wait until the running requests are freed."""
    with connect(endpoint, timeout_s, admin_key) as client:
        body = client.call("drain", enable=not cancel)
        if cancel or not wait:
            emit(body, as_json, lambda: click.echo(f"draining: {body['draining']}, {body['requests']} requests left"))
            return
        if body["requests"]:
            _wait_drained(client, body["requests"], wait_timeout, quiet=as_json)
        emit({"draining": True, "requests": 0}, as_json, lambda: click.echo("drained: no requests left"))


def _wait_drained(client, total: int, wait_timeout: float, quiet: bool) -> None:
    from tqdm import tqdm

    backoff = DRAIN_POLL.with_deadline(wait_timeout).start()
    with tqdm(total=total, desc="freed", unit="req", disable=quiet) as bar:
        while (left := client.call("drain", enable=True)["requests"]) > 0:
            bar.update(max(0, total - left - bar.n))
            if backoff.expired():
                raise click.ClickException(f"{left} requests still running after {wait_timeout}s")
            time.sleep(backoff.advance())
        bar.update(total - bar.n)


@click.command("drop-pool")
@click.argument("pool")
@click.option("--force", is_flag=True, help="Even while live workers hold its shards (they must re-register).")
@client_options
def drop_pool(pool: str, force: bool, endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Forget a pool: free its requests, clear its cache (KV events say so), release its memory.

    For a pool whose workers are gone for good (`kvpool status` reports it lost or idle);
    refused while a live worker session holds one of its shards, unless --force.
    """
    body = ask(endpoint, timeout_s, admin_key, "drop_pool", pool=pool, force=force)
    emit(body, as_json, lambda: click.echo(f"pool {pool}: dropped ({body['freed']} requests freed)"))


@click.command("shutdown")
@client_options
def shutdown(endpoint: str, timeout_s: float, admin_key: str | None, as_json: bool) -> None:
    """Stop the manager (it finishes the current iteration and exits 0)."""
    with connect(endpoint, timeout_s, admin_key) as client:
        body = client.call("shutdown")
        client.sid = None  # the manager is going away: no deregister
    emit(body, as_json, lambda: click.echo(f"manager {endpoint}: shutting down"))
