"""Retention pins: a prefix's hash chain kept from eviction for a bounded time.

Pure Python, no I/O, no clock: every call that depends on time takes ``now`` (seconds, any
monotonic origin the caller keeps), so tests and a recovered manager decide expiry alike.

A pin names hashes, not blocks: a pinned hash is kept in whichever levels hold it, now or when
it arrives later (a prefix pinned before it was ever demoted is kept once it is). The pins of
one tier together name at most ``limit`` distinct hashes per level (a share of that level's
blocks), so pins can never take a level whole and starve every save: a pin beyond the bound is
refused (``PinRefused``, with the figures), nothing else changes. Two pins may name the same
hash; it stays pinned until the last of them ends.

When a pin expires its hashes become evictable again, at the most recent end of their LRU
class (``NodeTier.expire``); the tier remembers them until they are used again, so a later
removal says ``expired_pin`` rather than plain ``evicted``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_TTL_S = 30 * 24 * 3600.0  # a pin longer than a month is a mistake, not a retention policy


@dataclass(frozen=True, slots=True)
class PinInfo:
    """One pin as ``kvpool pins`` lists it."""

    pin_id: int
    num_hashes: int
    expires_at: float
    remaining_s: float  # at the ``now`` it was listed at

    def to_wire(self) -> dict:
        return {"pin_id": self.pin_id, "num_hashes": self.num_hashes, "expires_at": self.expires_at,
                "remaining_s": self.remaining_s}


@dataclass(frozen=True, slots=True)
class PinRefused:
    """A pin that would take more than the pinned share of ``level``: ``pinned`` hashes are
    pinned now, this one adds ``asked`` more, at most ``limit`` may be (``share`` of
    ``num_blocks`` usable blocks)."""

    level: str
    asked: int
    pinned: int
    limit: int
    share: float
    num_blocks: int

    @property
    def message(self) -> str:
        return (f"pin refused: it adds {self.asked} blocks to the {self.pinned} pinned in the {self.level} "
                f"level, which keeps at most {self.limit} pinned ({self.share:.0%} of {self.num_blocks} "
                f"blocks): unpin some, pin a shorter prefix or raise the pinned share")


@dataclass(slots=True)
class _Pin:
    hashes: tuple[bytes, ...]
    expires_at: float


class PinTable:
    """The pins of one node tier: which hashes are pinned, until when, and the share bound."""

    def __init__(self, usable: dict[str, int], share: float) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"the pinned share must be in [0, 1), got {share}")
        self.share = share
        self.usable = dict(usable)  # level -> usable blocks (the null block excluded)
        self.limits = {level: int(share * n) for level, n in usable.items()}
        self.pins: dict[int, _Pin] = {}
        self.count: dict[bytes, int] = {}  # hash -> the pins naming it
        self._next_id = 1

    def is_pinned(self, h: bytes) -> bool:
        return h in self.count

    def add(self, hashes: Sequence[bytes], ttl_s: float, now: float) -> tuple[int, list[bytes]] | PinRefused:
        """A new pin: (its id, the hashes pinned by it alone), or PinRefused (nothing changed)."""
        if not hashes:
            raise ValueError("a pin names at least one block hash")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"a pin's ttl must be in (0, {MAX_TTL_S:.0f}] seconds, got {ttl_s}")
        unique = tuple(dict.fromkeys(hashes))
        new = [h for h in unique if h not in self.count]
        for level, limit in self.limits.items():
            if len(self.count) + len(new) > limit:
                return PinRefused(level, len(new), len(self.count), limit, self.share, self.usable[level])
        pin_id, self._next_id = self._next_id, self._next_id + 1
        self.pins[pin_id] = _Pin(unique, now + ttl_s)
        for h in unique:
            self.count[h] = self.count.get(h, 0) + 1
        return pin_id, new

    def remove(self, pin_id: int) -> list[bytes] | None:
        """Ends a pin; the hashes no other pin names (None: no such pin)."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return None
        released = []
        for h in pin.hashes:
            n = self.count[h] - 1
            if n:
                self.count[h] = n
            else:
                del self.count[h]
                released.append(h)
        return released

    def expired(self, now: float) -> list[int]:
        """The pins whose time is up at ``now``, oldest id first."""
        return [pid for pid, pin in self.pins.items() if pin.expires_at <= now]

    def listing(self, now: float) -> list[PinInfo]:
        return [PinInfo(pid, len(p.hashes), p.expires_at, max(0.0, p.expires_at - now))
                for pid, p in self.pins.items()]

    def to_wire(self) -> dict:
        """The pins as a snapshot keeps them (manager/core/node_snapshot.py)."""
        return {"next_id": self._next_id,
                "pins": [[pid, b"".join(p.hashes), p.expires_at] for pid, p in self.pins.items()]}

    def restore(self, d: dict, split: Callable[[bytes], list[bytes]]) -> None:
        """Fills this empty table from ``to_wire`` output (``split``: concatenated hashes ->
        hashes); TypeError or ValueError when it is not whole. The counts follow from the pins."""
        next_id = d["next_id"]
        if type(next_id) is not int or next_id < 1:
            raise TypeError(f"pin table next_id {next_id!r:.20}")
        for pid, hashes, expires_at in d["pins"]:
            if type(pid) is not int or not 0 < pid < next_id or pid in self.pins or type(expires_at) not in (int, float):
                raise ValueError(f"pin row {pid!r:.20}: a repeated or out-of-range id, or no expiry")
            pin = self.pins[pid] = _Pin(tuple(split(hashes)), float(expires_at))
            if not pin.hashes:
                raise ValueError(f"pin {pid} names no hash")
            for h in pin.hashes:
                self.count[h] = self.count.get(h, 0) + 1
        self._next_id = next_id

    def check(self) -> list[str]:
        """What is wrong with the table (empty when nothing is): counts and the share bound."""
        want: dict[bytes, int] = {}
        for pin in self.pins.values():
            for h in pin.hashes:
                want[h] = want.get(h, 0) + 1
        problems = [] if want == self.count else ["pin counts disagree with the pins"]
        for level, limit in self.limits.items():
            if len(self.count) > limit:
                problems.append(f"{len(self.count)} hashes pinned in {level}, over its limit {limit}")
        return problems
