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
