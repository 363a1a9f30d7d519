"""A pool's link to the node tier of its layout (manager/core/node_tier.py): which of a
request's prefix blocks come from it, and the copies of one step.

Pure Python, no I/O. A ``Pool`` (manager/core/pool.py) with a node tier calls this at three
points; every order goes into the step's batch (``owner``, set by manager/core/step.py for each
step) and into one of two lists, which the step puts in the sub-op's result
(shared/node_orders.py ``NodeOrders``):

  * admission (``plan``, then ``take`` before the device blocks are taken, then ``load``): the
    longest run of the prompt's blocks after the device and private host hits that the tier can
    bring up *now*. A host-level hit is loaded to the device; a disk-level hit is prefetched into
    a host slot and loaded from there in the same batch (``pre``: the worker runs the disk read
    and verifies it, then the host read and verifies it). ``plan`` stops the run where a disk
    hit would find no free host slot, or its hash is being written to host memory by another
    batch, so the cached count it admits with is exact and the admission changes nothing when
    refused for space. Every hit is held before the device blocks are taken, since reusing a
    device block may save into the tier.
  * a cached device block handed out again (``demote``, ``pre``): saved to host memory unless
    the tier holds its hash, before the step overwrites it. A pool with a private host tier
    saves it there instead (manager/core/host_tier.py), and the node tier takes what *that*
    tier hands out again (``demote_private``: a ``Save`` with ``source="private"``), so the
    levels hold different blocks: device, then private host, then the node's host memory, then
    disk. A block hashed in this same step
    (computed by this step's forward pass) is never saved before it: if it had a save ordered
    after the forward (``write``), that save is withdrawn, since the block now receives other
    tokens.
  * blocks that become full in this step (``write``, ``post``), only while more than one pool
    shares the tier (``NodeTier.eager``): saved after the forward pass that computes them, so
    another pool of the layout finds them at once. The worker saves only
    a block its forward pass did fill, and reports the others failed (worker/node_copier.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.manager.core.node_tier import Hit, NodeTier
from kvpool.shared.node_orders import Load, Order, Save


class HitCounts(Protocol):
    """Where a link counts the prompt tokens its pool took from each level (the pool's
    ``PoolStats``: a snapshot keeps them)."""

    node_host_hit_tokens: int
    node_disk_hit_tokens: int


class NodeLink:
    def __init__(self, tier: NodeTier, block_size: int, stats: HitCounts) -> None:
        self.tier = tier
        self.block_size = block_size
        self.stats = stats  # the pool's (its node-tier hit counts travel in its snapshot)
        self.owner: object = None  # this step's batch (manager/core/step.py sets it)
        self.pre: list[Order] = []  # this sub-op's orders before the forward pass
        self.post: list[Order] = []  # and after it
        self.posted: dict[int, list[Order]] = {}  # device block -> its post save (+ write-down), this step
        self.priority = 0  # the admitting request's (vLLM's meaning: lower is more important)

    @property
    def hit_tokens(self) -> dict[str, int]:
        """Prompt tokens this pool took from each level."""
        return {"host": self.stats.node_host_hit_tokens, "disk": self.stats.node_disk_hit_tokens}

    def plan(self, hashes: Sequence[bytes]) -> list[Hit]:
        """The run of ``hashes`` the tier can bring up in this step (no side effects)."""
        tier = self.tier
        hits = tier.lookup(hashes)
        host = tier.host
        ref = host.blocks.ref_cnt
        free = host.blocks.num_free - len({hit.slot for hit in hits if hit.level == "host" and ref[hit.slot] == 0})
        for i, hit in enumerate(hits):
            if hit.level == "disk":
                if free <= 0 or host.holds(hit.key):
                    return hits[:i]
                free -= 1
        return hits

    def take(self, hits: list[Hit]) -> list[Hit]:
        """Holds ``hits`` and prefetches the disk ones into host slots: the host hits to load,
        one per hit, in order. Call before the device blocks are taken."""
        tier, owner = self.tier, self.owner
        tier.hold(owner, [hit for hit in hits if hit.level == "host"])
        orders = tier.prefetch(owner, hits, self.priority)
        self.pre += orders
        landed = {o.key: o.dst for o in orders if type(o) is Load and o.frm == "disk"}
        for hit in hits:
            if hit.level == "host":
                self.stats.node_host_hit_tokens += self.block_size
            else:
                self.stats.node_disk_hit_tokens += self.block_size
        return [hit if hit.level == "host" else Hit("host", landed[hit.key], hit.key) for hit in hits]

    def load(self, hits: list[Hit], device_blocks: Sequence[int]) -> None:
        self.pre += self.tier.load(self.owner, hits, device_blocks, self.priority)

    def demote(self, device_block: int, h: bytes) -> None:
        self.pre += self.tier.save(self.owner, device_block, h, None, self.priority)

    def demote_private(self, host_block: int, h: bytes) -> None:
        """The pool's private host tier hands ``host_block`` (holding ``h``) out again: saved
        down to the node's host memory first (the worker reads it before that tier's saves)."""
        self.pre += self.tier.save(self.owner, host_block, h, None, self.priority, "private")

    def withdraw(self, device_block: int) -> None:
        """``device_block``, hashed in this step, is handed out again within it: the save
        ordered after the forward would copy other tokens under its hash."""
        orders = self.posted.pop(device_block, None)
        if orders:
            self.tier.withdraw(self.owner, orders)
            self.post = [o for o in self.post if o not in orders]

    def write(self, device_blocks: Sequence[int], hashes: Sequence[bytes], parent: bytes | None) -> None:
        """Saves after the forward pass of blocks it computes (full as of this step)."""
        for b, h in zip(device_blocks, hashes):
            orders = self.tier.save(self.owner, b, h, parent, self.priority)
            if orders:
                self.post += orders
                self.posted[b] = [o for o in orders if not (type(o) is Save and o.to == "disk" and o.key != h)]
            parent = h

    def take_orders(self) -> tuple[list[Order], list[Order]]:
        pre, post = self.pre, self.post
        if pre or post:
            self.pre, self.post = [], []
        return pre, post

    def end_step(self) -> None:
        """The step's orders are all out; a batch that ordered nothing ends now."""
        self.tier.close_if_empty(self.owner)
        self.posted.clear()
        self.owner = None
