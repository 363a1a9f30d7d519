"""A node tier's complete state as msgpack-ready plain data, and back (pure, no I/O).

What a state snapshot carries of each layout's node tier (manager/core/node_tier.py), so a
manager recovered from Redis, or restored from a file, replays its journal against the very
index the live manager ran: its size and policy, each level's slots (ref counts, free queue,
hash map: ``snapshot.dump_blocks``), their priorities and hit counts, the retained and landing
slots, the open batches (their references and orders: a worker reports them after the restart),
the retention pins, the hashes of expired pins, the batch counter, each level's counters and the
sessions of the engines that joined it.
A level's per-priority eviction classes are not stored: they are the free queue's LRU order
split by priority (``NodeLevel.check_invariants`` says so), rebuilt here.

Restoring verifies nothing by itself (the caller checks the whole registry once), but every
field is checked for its type and size: a malformed dump raises ``CorruptState``.
"""

from __future__ import annotations

from dataclasses import asdict

from kvpool.manager.core.node_level import REASONS, LevelStats, NodeLevel
from kvpool.manager.core.node_tier import NodeTier, TierBatch
from kvpool.manager.core.snapshot import (
    CorruptState,
    dump_blocks,
    ints,
    load_blocks,
    sints,
    split_hashes,
    unints,
    unsints,
)
from kvpool.shared.node_orders import order_from_wire
from kvpool.shared.protocol import ManagerError

FORMAT = 1


def _owner_to_wire(owner: object) -> object:
    if type(owner) is tuple:
        return list(owner)
    if type(owner) in (str, int):
        return owner
    raise ValueError(f"a node-tier batch owner {owner!r:.60} cannot be stored (a tuple, str or int can)")


def _owner_from_wire(raw: object) -> object:
    return tuple(raw) if type(raw) is list else raw


def dump_tier(tier: NodeTier) -> dict:
    """The tier as plain data (between steps: a step's link state is not stored)."""
    batches = list(tier.batches.items())
    index = {id(batch): i for i, (_, batch) in enumerate(batches)}
    return {
        "format": FORMAT,
        "config": [tier.host.num_blocks, tier.disk.num_blocks if tier.disk is not None else 0, tier.block_size,
                   tier.host.block_bytes, tier.policy, tier.admit_hits, tier.pins.share],
        "levels": {name: _dump_level(lv, index) for name, lv in tier.levels.items()},
        "batches": [[_owner_to_wire(owner), [[lv, b, n] for (lv, b), n in batch.refs.items()],
                     [o.to_wire() for o in batch.orders]] for owner, batch in batches],
        "pins": tier.pins.to_wire(),
        "expired": b"".join(tier.expired),
        "next_batch": tier.next_batch,
        "engines": sorted(tier.engines),
    }


def _dump_level(lv: NodeLevel, index: dict[int, int]) -> dict:
    return {**dump_blocks(lv.blocks), "prio": sints(lv.prio), "hits": sints(lv.hits),
            "retained": ints(sorted(lv.retained)),
            "landing": [[b, index[id(batch)]] for b, batch in lv.landing.items()],
            "stats": asdict(lv.stats)}


def load_tier(d: dict, enable_events: bool = False) -> NodeTier:
    """Rebuilds a tier from ``dump_tier`` output; CorruptState when a field is malformed."""
    try:
        return _load(d, enable_events)
    except CorruptState:
        raise
    except ManagerError as e:
        raise CorruptState(f"node tier snapshot: an order is malformed: {e.message}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptState(f"node tier snapshot is not loadable: {type(e).__name__}: {e}") from None


def _load(d: dict, enable_events: bool) -> NodeTier:
    if d.get("format") != FORMAT:
        raise CorruptState(f"node tier snapshot format {d.get('format')!r}, expected {FORMAT}")
    host_blocks, disk_blocks, block_size, block_bytes, policy, admit_hits, share = d["config"]
    tier = NodeTier(host_blocks, disk_blocks, block_size, block_bytes, policy=policy, admit_hits=admit_hits,
                    pin_share=share, enable_events=enable_events)
    batches: list[TierBatch] = []
    for owner, refs, orders in d["batches"]:
        batch = TierBatch()
        for name, b, n in refs:
            if name not in tier.levels or type(b) is not int or type(n) is not int or n < 1:
                raise CorruptState(f"node tier snapshot: a batch reference {name!r:.10} {b!r:.10} x{n!r:.10}")
            batch.refs[(name, b)] = n
        batch.orders = [order_from_wire(o) for o in orders]
        key = _owner_from_wire(owner)
        if key in tier.batches:
            raise CorruptState(f"node tier snapshot: batch {key!r:.60} twice")
        tier.batches[key] = batch
        batches.append(batch)
    if set(d["levels"]) != set(tier.levels):
        raise CorruptState(f"node tier snapshot: levels {sorted(d['levels'])}, the tier has {sorted(tier.levels)}")
    for name, lv in tier.levels.items():
        _load_level(lv, d["levels"][name], batches, enable_events)
    tier.pins.restore(d["pins"], lambda raw: split_hashes(raw, "pin hashes"))
    tier.expired = set(split_hashes(d["expired"], "expired pins"))
    next_batch = d["next_batch"]
    if type(next_batch) is not int or next_batch < 1:
        raise CorruptState(f"node tier snapshot: next_batch {next_batch!r:.20}")
    tier.next_batch = next_batch
    engines = d.get("engines", [])  # (absent in snapshots from before engines joined)
    if type(engines) is not list or any(type(sid) is not str for sid in engines):
        raise CorruptState(f"node tier snapshot: engines {str(engines)[:60]}")
    tier.engines = set(engines)
    return tier


def _load_level(lv: NodeLevel, d: dict, batches: list[TierBatch], enable_events: bool) -> None:
    n = lv.num_blocks
    bp = load_blocks(d, enable_events)
    prio, hits = unsints(d["prio"], "prio"), unsints(d["hits"], "hits")
    if bp.num_blocks != n or len(prio) != n or len(hits) != n:
        raise CorruptState(f"node tier {lv.name} level: {bp.num_blocks} blocks, {len(prio)} priorities and "
                           f"{len(hits)} hit counts for a level of {n}")
    lv.blocks, lv.prio, lv.hits = bp, prio, hits
    lv.retained = set(unints(d["retained"], "retained"))
    lv.landing = {}
    for b, i in d["landing"]:
        if type(b) is not int or not 0 < b < n or type(i) is not int or not 0 <= i < len(batches):
            raise CorruptState(f"node tier {lv.name} level: landing slot {b!r:.10} of batch {i!r:.10}")
        lv.landing[b] = batches[i]
    stats = dict(d["stats"])
    removed = stats.pop("removed")
    if set(removed) != set(REASONS):
        raise CorruptState(f"node tier {lv.name} level: removal reasons {sorted(removed)}")
    lv.stats = LevelStats(**stats, removed=dict(removed))
    lv.classes = {}
    for b in bp.free_queue.order():  # the free queue's LRU order, split by priority
        if bp.block_hash[b] is not None:
            lv.classes.setdefault(prio[b], {})[b] = None
