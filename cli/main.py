"""The `kvpool` command: a click group; each owner module adds its commands."""

from __future__ import annotations

import logging

import click


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="kvpool")
def cli(verbose: int) -> None:
    """kvpool: a PagedAttention KV-cache memory system."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


from kvpool.cli import admin  # noqa: E402  (manager daemon + admin commands)

cli.add_command(admin.manager)
cli.add_command(admin.status)
cli.add_command(admin.pools)
cli.add_command(admin.sessions)
cli.add_command(admin.requests)
cli.add_command(admin.stats)
cli.add_command(admin.reset_cache)
cli.add_command(admin.evict)
cli.add_command(admin.drain)
cli.add_command(admin.shutdown)
cli.add_command(admin.drop_pool)

from kvpool.cli import external  # noqa: E402  (attach, detach, externals: vLLM servers)

cli.add_command(external.attach)
cli.add_command(external.detach)
cli.add_command(external.externals)

from kvpool.cli import pins  # noqa: E402  (pin, pins, unpin: retention)

cli.add_command(pins.pin)
cli.add_command(pins.pins)
cli.add_command(pins.unpin)

from kvpool.cli import serve  # noqa: E402  (worker, generate, demo)

cli.add_command(serve.worker)
cli.add_command(serve.generate)
cli.add_command(serve.demo)

from kvpool.cli import state  # noqa: E402  (snapshot, restore)

cli.add_command(state.snapshot)
cli.add_command(state.restore)

from kvpool.cli import tools  # noqa: E402  (config show, events, keygen)

cli.add_command(tools.config)
cli.add_command(tools.events)
cli.add_command(tools.keygen)

from kvpool.cli import frontdoor  # noqa: E402  (serve: the HTTP front door)

cli.add_command(frontdoor.serve)

from kvpool.cli import bench as _bench  # noqa: E402

cli.add_command(_bench.bench)
