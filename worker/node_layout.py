"""What a node-store slot is: the layout it belongs to, its header, its checksum, its failures.

A store belongs to one ``StoreLayout``: the ``KVSpec`` (block size, layers, this shard's heads,
head size, dtype), the model's identity and the shard (rank of world). The spec alone is not
enough: two models of one shape (a base model and its fine-tune) hash the same tokens to the
same block hashes but compute other K/V, and the checksum cannot tell (both blocks are whole);
two tensor-parallel ranks hold different heads of one block hash. So the layout id is SHA-256 of
all of it, names the store's files and is in every header: different layouts never share a
store, and a block of another layout never verifies.

Header (64 bytes, little-endian): magic u32 ``KVNS``, version u16, flags u16, commit u32 (``KVOK``
once the slot is whole; 0 while it is written), length u32 (bytes of K/V), checksum u64, layout
id 8 bytes, key (the block hash) 32 bytes.

Checksum: xxh3-64 of layout id, key and bytes. Measured (scripts/bench_node_store.py, this
machine, one block of the tiny preset, 8 KiB): zlib.crc32 costs about 2x a memcpy of the block,
xxh3-64 about a tenth of it; for 64 KiB (small preset) crc32 costs tens of copies, xxh3 under
one; so crc32 would make verification the dominant cost of a host-memory load and xxh3 keeps it
in the noise. 64 bits: a torn or stale block passes with probability 2^-64, and the key is
compared exactly besides.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvpool.shared.protocol import KVSpec

HEADER = struct.Struct("<IHHIIQ8s32s")
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

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a store layout needs the model's identity (blocks of other weights differ)")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"shard rank {self.rank} is not in [0, {self.world})")

    @property
    def layout_id(self) -> bytes:
        wire = {k: v for k, v in self.spec.to_wire().items() if k != "max_model_len"}  # not a layout field
        doc = json.dumps({"spec": wire, "model": self.model, "rank": self.rank, "world": self.world},
                         sort_keys=True).encode()
        return hashlib.sha256(doc).digest()[:8]

    @property
    def name(self) -> str:
        return self.layout_id.hex()

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_size)

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.spec.dtype]

    def empty_block(self) -> torch.Tensor:
        return torch.empty(self.block_shape, dtype=self.dtype)

    def as_bytes(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` (one block of this layout, on the CPU, contiguous) as flat uint8."""
        if block.device.type != "cpu" or block.dtype != self.dtype or tuple(block.shape) != self.block_shape:
            raise ValueError(f"a block of this layout is a CPU {self.dtype} tensor {list(self.block_shape)}, got "
                             f"{block.device.type} {block.dtype} {list(block.shape)}")
        if not block.is_contiguous():
            raise ValueError("a block must be contiguous (its bytes are stored as they lie)")
        return block.view(torch.uint8).reshape(-1)


def checksum(layout_id: bytes, key: bytes, data: torch.Tensor) -> int:
    """xxh3-64 of the layout id, the key and ``data`` (flat uint8 on the CPU)."""
    h = xxhash.xxh3_64(layout_id)
    h.update(key)
    h.update(memoryview(data.numpy()))
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
