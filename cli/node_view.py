"""How `kvpool stats` shows the tiers: each pool's hits by where they came from, and the node
tiers' levels (manager/node_tiers.py)."""

from __future__ import annotations

import click

from kvpool.cli.common import table


def hits_by_level(r: dict) -> str:
    """A pool's prefix hit rate split by where the tokens came from."""
    looked = r.get("lookup_tokens") or 0
    host, nh, nd = r.get("host_hit_tokens", 0), r.get("node_host_hit_tokens", 0), r.get("node_disk_hit_tokens", 0)
    device = r.get("hit_tokens", 0) - host - nh - nd
    return "/".join(f"{n / looked:.1%}" if looked else "-" for n in (device, host, nh, nd))


def node_row(layout: str, name: str, u: dict) -> dict:
    lv = u[name]
    removed = ", ".join(f"{k} {v}" for k, v in lv["removed"].items() if v) or "-"
    return {"layout": layout, "level": name, "cached": f"{lv['cached_blocks']}/{lv['num_blocks'] - 1}",
            "hits": lv["hits"], "saves": lv["saves"], "loads": lv["loads"], "verify_failures": lv["verify_failures"],
            "deadline_misses": lv.get("deadline_misses", 0), "save_failures": lv["save_failures"], "removed": removed, "policy": u["policy"]}


def print_node_tiers(tiers: dict) -> None:
    if not tiers:
        return
    click.echo("node tiers:")
    table([node_row(layout, name, u) for layout, u in tiers.items() for name in ("host", "disk") if name in u],
          [("LAYOUT", "layout"), ("LEVEL", "level"), ("CACHED", "cached"), ("HITS", "hits"), ("SAVES", "saves"),
           ("LOADS", "loads"), ("VERIFY_FAILED", "verify_failures"), ("LATE", "deadline_misses"),
           ("SAVE_FAILED", "save_failures"),
           ("REMOVED", "removed"), ("POLICY", "policy")])
