"""The whole registry's invariants, checked before a recovered or restored state is served.

Each pool in bulk (manager/core/verify.py), then what ties pools to sessions: every request
belongs to a live session (or to a pin), every ready pool has all its shards; each node tier's
invariants, and every pin holding has its pin. Raises ``CorruptState``
(explicit checks, kept under ``python -O``). The cyclic garbage collector is paused while a
large state is built and checked: it would otherwise traverse millions of fresh objects again
and again (it more than doubled recovery time at 1M blocks).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.pool import PIN_OWNER
from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.core.verify import verify_pool
from kvpool.manager.state.pins import check_pins
from kvpool.manager.store.view import StateView


def verify_registry(reg: StateView, what: str = "state") -> None:
    try:
        _verify(reg, what)
    except CorruptState as e:
        raise CorruptState(f"the state breaks an invariant: {e}") from None


def _verify(reg: StateView, what: str) -> None:
    for entry in reg.pools.values():
        if entry.pool is None:
            continue
        verify_pool(entry.pool, f"{what}: pool {entry.name}")
        owners = {key[0] for key in entry.pool.requests if type(key) is tuple}
        dead = owners - reg.sessions.keys() - {PIN_OWNER}  # a pin's holdings: checked with the pins
        if dead or any(type(key) is not tuple for key in entry.pool.requests):
            raise CorruptState(f"{what}: pool {entry.name} holds requests of {len(dead)} sessions that do not exist")
        if len(entry.shards) != entry.shard_count:
            raise CorruptState(f"{what}: pool {entry.name} is ready with {len(entry.shards)} of "
                               f"{entry.shard_count} shards")
    tiers = reg.node_tier_list()
    try:
        for _, tier in tiers:
            tier.check_invariants()
        check_pins(reg.pins, reg.pools, {info.layout: tier for info, tier in tiers})
    except InvariantBroken as e:
        raise CorruptState(f"{what}: {e}") from None


@contextmanager
def gc_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
