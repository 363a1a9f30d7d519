"""Retention pins across the manager: a prefix kept from eviction in a pool's device blocks and
in every level of its node tier, for a bounded time, within a bounded share of each.

``Registry`` (manager/registry.py) owns the table and changes it through its journaled records
(manager/state/mutations.py ``PinAdded``, ``PinRemoved``). A pin names a prefix's hash chain:
  * in the pool's device blocks, the leading blocks cached when it is made are held
    (``Pool.pin``: a holding under ``PIN_OWNER``, counted like a request's) until it ends; a
    block cached later is not taken;
  * in the node tier (manager/core/retention.py) every hash it names is kept in whichever level
    holds it, now or later.
Each is refused (``pin_refused``, with the figures) when it would take a tier past its pinned
share (``node_tier_pin_share``, 0.25 by default). Times are wall-clock seconds (``time.time()``:
they mean the same after a restart); a pin ends at ``expires_at`` (the manager's expiry tick),
by ``unpin``, or with its pool.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SHARE = 0.25


@dataclass
class Pin:
    pin_id: int
    pool: str
    hashes: tuple[bytes, ...]
    expires_at: float
    node_pin: int | None  # its id in the node tier's table (None: the pool has no node tier)
    layout: str | None  # that node tier's layout
    device_blocks: int  # blocks held in the pool's device tier

    def row(self, now: float) -> dict:
        """The pin as `pins` lists it."""
        return {"pin_id": self.pin_id, "pool": self.pool, "num_hashes": len(self.hashes),
                "device_blocks": self.device_blocks, "node": self.node_pin is not None,
                "expires_at": self.expires_at, "remaining_s": max(0.0, self.expires_at - now)}


class Pins:
    def __init__(self) -> None:
        self.pins: dict[int, Pin] = {}
        self.next_id = 1

    def take_id(self) -> int:
        pin_id, self.next_id = self.next_id, self.next_id + 1
        return pin_id

    def due(self, now: float) -> list[int]:
        """The pins whose time is up at ``now``."""
        return [p.pin_id for p in self.pins.values() if p.expires_at <= now]
