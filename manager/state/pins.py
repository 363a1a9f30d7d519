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
by ``unpin``, or with its pool. A state snapshot carries the table (``Pins.to_wire``); its
holdings in the pools' blocks travel as the pools' requests, and ``check_pins`` ties the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool import PIN_OWNER
from kvpool.manager.state.entries import PoolEntry
from kvpool.shared.hashing import HASH_BYTES

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

    def to_wire(self) -> list:
        """The pin as a state snapshot keeps it (manager/store/state_file.py)."""
        return [self.pin_id, self.pool, b"".join(self.hashes), self.expires_at, self.node_pin, self.layout,
                self.device_blocks]

    @classmethod
    def from_wire(cls, row: list) -> Pin:
        """A snapshot's pin row; TypeError or ValueError when it is not one."""
        pin_id, pool, hashes, expires_at, node_pin, layout, device_blocks = row
        if (type(pin_id) is not int or type(pool) is not str or type(hashes) is not bytes or not hashes
                or len(hashes) % HASH_BYTES or type(expires_at) not in (int, float)
                or (node_pin is not None and type(node_pin) is not int) or (layout is not None and type(layout) is not str)
                or type(device_blocks) is not int or device_blocks < 0):
            raise TypeError(f"pin row {str(row)[:80]}")
        return cls(pin_id, pool, tuple(hashes[i:i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)),
                   float(expires_at), node_pin, layout, device_blocks)

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

    def to_wire(self) -> dict:
        return {"next_id": self.next_id, "pins": [p.to_wire() for p in self.pins.values()]}

    @classmethod
    def from_wire(cls, d: dict) -> Pins:
        """A snapshot's pins; TypeError or ValueError when they are not whole."""
        out = cls()
        next_id = d["next_id"]
        for row in d["pins"]:
            pin = Pin.from_wire(row)
            if pin.pin_id in out.pins or pin.pin_id >= next_id:
                raise ValueError(f"pin {pin.pin_id} is repeated or not below next_id {next_id}")
            out.pins[pin.pin_id] = pin
        if type(next_id) is not int or next_id < 1:
            raise TypeError(f"pins' next_id {next_id!r:.20}")
        out.next_id = next_id
        return out

    def due(self, now: float) -> list[int]:
        """The pins whose time is up at ``now``."""
        return [p.pin_id for p in self.pins.values() if p.expires_at <= now]


def check_pins(pins: Pins, pools: Mapping[str, PoolEntry], tiers: Mapping[str, NodeTier]) -> None:
    """Every pin holding of a pool has its pin, and every pin's node-tier pin is in its layout's
    tier (a snapshot that kept holdings without their pins could never release them).
    Raises InvariantBroken."""
    for entry in pools.values():
        if entry.pool is None:
            continue
        for key in entry.pool.requests:
            if type(key) is tuple and key[0] == PIN_OWNER:
                pin = pins.pins.get(key[1])
                if pin is None or pin.pool != entry.name:
                    raise InvariantBroken(f"pool {entry.name!r} holds blocks for pin {key[1]}, which is not one of "
                                          "its pins")
    for pin in pins.pins.values():
        if pin.pin_id >= pins.next_id:
            raise InvariantBroken(f"pin {pin.pin_id} is not below the next id {pins.next_id}")
        if pin.node_pin is None:
            continue
        tier = tiers.get(pin.layout) if pin.layout is not None else None
        if tier is None or pin.node_pin not in tier.pins.pins:
            raise InvariantBroken(f"pin {pin.pin_id}: its node-tier pin {pin.node_pin} (layout {pin.layout}) is gone")
