"""`kvpool bench`: the block-pool core on the reference trace, in this process."""

from __future__ import annotations

import json

import click
from tqdm import tqdm

from kvpool.bench.pool import report_lines, run_trace
from kvpool.bench.trace import TraceConfig


@click.command("bench")
@click.option("--requests", default=TraceConfig.num_requests, show_default=True, type=click.IntRange(min=1))
@click.option("--blocks", default=TraceConfig.num_blocks, show_default=True, type=click.IntRange(min=2))
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def bench(requests: int, blocks: int, seed: int, as_json: bool) -> None:
    """Replay the reference trace against an in-process pool: CPU µs per request with hashing
    (hash, lookup+allocate, free), µs per block allocate+free, prefix hit rate. Medians over
    rounds: scripts/bench_pool.py; through the daemon: scripts/bench_manager.py."""
    cfg = TraceConfig(num_requests=requests, num_blocks=blocks, seed=seed)
    runs = {}
    for name, kw in (("with_hashing", {"hashing": True}), ("allocate_free_only", {"hashing": False, "caching": False})):
        with tqdm(total=requests, desc=name, unit="req", disable=as_json, leave=False) as bar:
            runs[name] = run_trace(cfg, progress=bar.update, **kw)
    if as_json:
        click.echo(json.dumps(runs, indent=2))
    else:
        click.echo("\n".join(report_lines(cfg, runs["with_hashing"], runs["allocate_free_only"])))
