"""The node tier's contract between the manager and the workers: layouts, slot counts, where
the levels live.

The manager keeps one node tier (manager/core/node_tier.py) per *layout*: the ``KVSpec`` (block
size, layers, this shard's heads, head size, dtype), the model's identity and the shard (rank of
world). The spec alone is not enough: two models of one shape (a base model and its fine-tune)
hash the same tokens to the same block hashes but compute other K/V, and no checksum can tell
(both blocks are whole); two tensor-parallel ranks hold different heads of one block hash. So the
layout id is SHA-256 of all of it (the first 8 bytes): it names the store's files, it is in every
slot header (worker/node_layout.py) and the manager keys its tiers by it, so different layouts
never share a slot and a block of another layout never verifies.

Both sides size the levels with the functions here, so they agree on every slot number: a host
slot is the 64-byte header and the block's bytes, rounded up to 64 bytes; a disk slot is one file
of the header and the bytes. Slot 0 is never used (the null slot).

``NodeTierInfo`` is what a worker learns at registration (register's reply, ``node_tier``): its
layout, the shared-memory file of the host level and its slot count, the disk level's directory,
budget and slot count (none: no disk level).

A tensor-parallel pool of ``world`` ranks has one tier (one bookkeeping: a slot number names the
same block hash in every rank's store) and one store per rank: rank r's files are named by
``layout_id(spec, model, r, world)`` (``shard_stores``; the tier is named by rank 0's), sized so
that all ranks' stores together stay within the configured budgets.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvpool.shared.protocol import KVSpec, bad_field, get_int, get_str

HEADER_BYTES = 64  # a slot's header (worker/node_layout.py HEADER)
MAX_MODEL_ID = 512  # characters of a model identity
MAX_PATH = 4096
MAX_WORLD = 4096  # ranks of a tensor-parallel pool (register's shard_count)
# how long a step waits for its disk reads (recomputing what they would have brought) and its
# write-downs (dropped)
# (worker/node_disk_io.py; the worker's node_tier_read_timeout, the vLLM connector's read_timeout_s)
READ_TIMEOUT_S = 5.0


def layout_id(spec: KVSpec, model: str, rank: int = 0, world: int = 1) -> bytes:
    """The 8-byte id of a layout (``max_model_len`` is not a layout field: it changes no byte)."""
    if not model:
        raise ValueError("a node-tier layout needs the model's identity (blocks of other weights differ)")
    if not 0 <= rank < world:
        raise ValueError(f"shard rank {rank} is not in [0, {world})")
    wire = {k: v for k, v in spec.to_wire().items() if k != "max_model_len"}
    doc = json.dumps({"spec": wire, "model": model, "rank": rank, "world": world}, sort_keys=True).encode()
    return hashlib.sha256(doc).digest()[:8]


def shard_stores(spec: KVSpec, model: str, world: int) -> tuple[str, ...]:
    """The store names (hex layout ids) of a pool's ranks 0..world-1; the first names its tier."""
    return tuple(layout_id(spec, model, r, world).hex() for r in range(world))


def host_stride(block_bytes: int) -> int:
    """Bytes of one host slot: the header and the block, rounded up to 64."""
    return -(-(HEADER_BYTES + block_bytes) // 64) * 64


def host_slots(block_bytes: int, memory_bytes: int) -> int:
    """Slots (the null slot included) of a host level of ``memory_bytes``."""
    return memory_bytes // host_stride(block_bytes)


def disk_slots(block_bytes: int, budget_bytes: int) -> int:
    """Slots (the null slot included: it is never a file) of a disk level of ``budget_bytes``."""
    return budget_bytes // (HEADER_BYTES + block_bytes) + 1


NODE_TOPIC = "node/"  # KV-event topics of the node tiers: never a pool name (those have no "/")


def node_topic(layout: str) -> str:
    """The KV-event topic of ``layout``'s node tier (PROTOCOL.md section 9)."""
    return NODE_TOPIC + layout


def host_file(directory: str, layout: str) -> str:
    """The shared-memory file of ``layout``'s host level."""
    return f"{directory.rstrip('/')}/kvpool-node-{layout}.host"


@dataclass(frozen=True, slots=True)
class NodeTierInfo:
    """Where one layout's node tier lives, as register's reply hands it to a worker."""

    layout: str  # the layout id, hex
    host_dir: str  # rank r's host file is host_file(host_dir, store(r))
    host_slots: int
    disk_dir: str | None = None  # rank r's disk files are under disk_dir/store(r)/
    disk_bytes: int = 0
    disk_slots: int = 0
    policy: str = "demote"
    # a tensor-parallel pool's stores, rank by rank (stores[0] == layout); empty: one store, the
    # layout's. Each rank's host file holds host_slots slots and its disk level disk_bytes
    stores: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return len(self.stores) or 1

    def store(self, rank: int) -> str:
        """The store (layout id, hex) rank ``rank`` maps."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in this tier's [0, {self.world})")
        return self.stores[rank] if self.stores else self.layout

    def to_wire(self) -> dict:
        out: dict = {"layout": self.layout, "host_dir": self.host_dir, "host_slots": self.host_slots,
                     "policy": self.policy}
        if self.disk_dir is not None:
            out.update(disk_dir=self.disk_dir, disk_bytes=self.disk_bytes, disk_slots=self.disk_slots)
        if self.stores:
            out["stores"] = list(self.stores)
        return out

    @classmethod
    def from_wire(cls, m: object) -> NodeTierInfo:
        if type(m) is not dict:
            raise bad_field("node_tier", "a map {layout, host_dir, host_slots, ...}", m)
        layout = _hex_id(get_str(m, "layout", 16), "node_tier.layout")
        disk_dir = get_str(m, "disk_dir", MAX_PATH) if "disk_dir" in m else None
        stores = m.get("stores", [])
        if type(stores) is not list or len(stores) > MAX_WORLD or (stores and (len(stores) < 2 or stores[0] != layout)):
            raise bad_field("node_tier.stores", f"a list of 2 to {MAX_WORLD} layout ids, the first the layout", stores)
        return cls(layout, get_str(m, "host_dir", MAX_PATH), get_int(m, "host_slots", 2, 1 << 40), disk_dir,
                   get_int(m, "disk_bytes", 0, 1 << 62, default=0), get_int(m, "disk_slots", 0, 1 << 40, default=0),
                   get_str(m, "policy", 32, default="demote"),
                   tuple(_hex_id(s, "node_tier.stores") for s in stores))


def _hex_id(v: object, name: str) -> str:
    if type(v) is not str or len(v) != 16 or any(c not in "0123456789abcdef" for c in v):
        raise bad_field(name, "16 hex digits", v)
    return v
