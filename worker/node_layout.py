"""What a node-store slot is: the layout it belongs to, its header, its checksum, its failures.

A store belongs to one ``StoreLayout``: the ``KVSpec``, the model's identity and the shard; its
id (shared/node_tier.py ``layout_id``, which says why all of it) names the store's files and is
in every header: different layouts never share a store, and a block of another layout never
verifies.

Header (64 bytes, little-endian): magic u32 ``KVNS``, version u16, flags u16, commit u32 (``KVOK``
once the slot is whole; 0 while it is written), length u32 (bytes of K/V), checksum u64, layout
id 8 bytes, key (the block hash) 32 bytes.

Checksum: xxh3-64 of layout id, key and bytes. Measured in one run (scripts/bench_node_store.py
on this 2-core machine, shared): one block of the tiny preset (fp32, 8 KiB) copies in 0.67 us
(numpy memcpy), zlib.crc32 takes 8.7 us (13x the copy) and xxh3-64 0.25 us (0.4x); a block of
the small preset (64 KiB): copy 2.5 us, crc32 54 us (21x), xxh3-64 1.6 us (0.6x). crc32 would
make verification the largest cost of a host-memory load (it runs at about 1 GB/s here against
memcpy's 12-26 GB/s); xxh3 keeps it under the copy. 64 bits: a torn or stale block passes with
probability 2^-64, and the key is compared exactly besides.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from kvpool.shared.node_tier import HEADER_BYTES, layout_id
from kvpool.shared.protocol import KVSpec

HEADER = struct.Struct("<IHHIIQ8s32s")
if HEADER.size != HEADER_BYTES:
    raise ImportError(f"the slot header is {HEADER.size} bytes, the node tier's contract says {HEADER_BYTES}")
MAGIC = int.from_bytes(b"KVNS", "little")
COMMIT = int.from_bytes(b"KVOK", "little")
VERSION = 1
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class NodeStoreError(RuntimeError):
    """A store that cannot be opened as configured (a size or layout that does not match)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a block was not stored or not loaded: ``reason`` one of missing, short_read,
    uncommitted, wrong_layout, wrong_key, mismatch, full, io_error, bad_slot."""

    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class StoreLayout:
    spec: KVSpec
    model: str  # the weights' identity: a checkpoint path and revision, or a preset and seed
    rank: int = 0
    world: int = 1
    layout_id: bytes = field(init=False, repr=False, compare=False)  # computed once: the hot path reads it
    block_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s = self.spec
        object.__setattr__(self, "layout_id", layout_id(s, self.model, self.rank, self.world))  # checks them
        object.__setattr__(self, "block_shape", (s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_size))

    @property
    def name(self) -> str:
        return self.layout_id.hex()

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.spec.dtype]

    def empty_block(self) -> torch.Tensor:
        return torch.empty(self.block_shape, dtype=self.dtype)

    def as_bytes(self, block: torch.Tensor) -> np.ndarray:
        """``block`` (one block of this layout, on the CPU, contiguous) as a flat uint8 numpy
        view of its memory (numpy: a plain memcpy and checksum on this thread)."""
        if block.shape != self.block_shape or block.dtype != self.dtype or block.device.type != "cpu":
            raise ValueError(f"a block of this layout is a CPU {self.dtype} tensor {list(self.block_shape)}, got "
                             f"{block.device.type} {block.dtype} {list(block.shape)}")
        if not block.is_contiguous():
            raise ValueError("a block must be contiguous (its bytes are stored as they lie)")
        return block.view(torch.uint8).numpy().reshape(-1)


def checksum(layout_id: bytes, key: bytes, data: np.ndarray) -> int:
    """xxh3-64 of the layout id, the key and ``data`` (flat uint8)."""
    h = xxhash.xxh3_64(layout_id)
    h.update(key)
    h.update(data)
    return h.intdigest()


def check_header(header: tuple, layout: StoreLayout, key: bytes, length: int) -> Failure | None:
    """What is wrong with a slot's header for a read of ``key`` (None: it may be checksummed)."""
    magic, version, _flags, commit, n, _sum, layout_id, stored_key = header
    if magic != MAGIC or version != VERSION:
        return Failure("uncommitted", "no slot header (never written, or written by another version)")
    if commit != COMMIT:
        return Failure("uncommitted", "the slot's write did not complete (a writer died or is still writing)")
    if layout_id != layout.layout_id:
        return Failure("wrong_layout", f"the slot holds a block of layout {layout_id.hex()}, not {layout.name}")
    if stored_key != key:
        return Failure("wrong_key", f"the slot holds block {stored_key.hex()[:16]}, not {key.hex()[:16]}")
    if n != length:
        return Failure("mismatch", f"the slot holds {n} bytes, a block of this layout {length}")
    return None
