"""Chained block hashing: the prefix-cache key of every full KV block.

    h_i = SHA-256( h_{i-1} || u32le(len(extra_i)) || extra_i || tokens_i )

- ``h_{-1}`` is ``SEED = SHA-256(b"kvpool/block-hash/v1")``.
- ``tokens_i`` are the ``block_size`` token ids of block ``i`` as little-endian uint32.
- ``extra_i`` is the canonical encoding of the extra keys of block ``i`` (empty when there are
  none): a sequence of items ``tag (1 byte) || u32le(len(payload)) || payload``, in tag order:
  ``0x01`` cache salt (UTF-8; block 0 only), ``0x02`` LoRA name (UTF-8; every block),
  ``0x03`` a multimodal input's offset from the block's first token (int32 little-endian,
  negative when the input began in an earlier block) followed by its identifier (UTF-8); every
  block the input's placeholder tokens overlap, in input order.

Only full blocks are hashed. The exact byte layout and test vectors are in PROTOCOL.md, so an
engine in another language produces identical hashes. Stdlib only: never ``hash()``, never pickle.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256
from struct import iter_unpack

HASH_BYTES = 32
SEED: bytes = sha256(b"kvpool/block-hash/v1").digest()
TAG_SALT, TAG_LORA, TAG_MM = 0x01, 0x02, 0x03
_NO_EXTRA = b"\x00\x00\x00\x00"  # u32le(0): the length prefix of an empty extra section
_EMPTY = sha256()  # never updated: hash_blocks copies it (read-only, so safe across threads)


@dataclass(frozen=True)
class MMInput:
    """A multimodal input occupying token positions [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32; raises OverflowError for ids outside [0, 2**32)."""
    return _u32le(tokens).tobytes()


def _u32le(tokens: Sequence[int]) -> array:
    """``tokens_to_bytes`` as the array itself (a buffer: the hash loop reads it without a copy)."""
    if type(tokens) is list:  # fromlist converts a list about 2x faster than array("I", list)
        arr = array("I")
        arr.fromlist(tokens)
    else:
        arr = array("I", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def _item(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


def extra_keys(
    block_index: int,
    block_size: int,
    cache_salt: str | None = None,
    lora: str | None = None,
    mm_inputs: Sequence[MMInput] = (),
) -> bytes:
    """The canonical ``extra_i`` of block ``block_index`` (b"" when it has no extra keys)."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    # each item's offset from the block's first token (< 0: it began in an earlier block)
    mm = [(m.offset - start, m.identifier) for m in mm_inputs if m.offset < end and m.offset + m.length > start]
    return block_extra(cache_salt if block_index == 0 else None, lora, mm)


def block_extra(cache_salt: str | None, lora: str | None, mm: Sequence[tuple[int, str]] = ()) -> bytes:
    """``extra_i`` from one block's keys: the salt (give it for block 0 only), the LoRA name and
    ``(offset from the block's first token, identifier)`` per multimodal item, in input order."""
    parts = []
    if cache_salt is not None:
        parts.append(_item(TAG_SALT, cache_salt.encode()))
    if lora is not None:
        parts.append(_item(TAG_LORA, lora.encode()))
    for offset, identifier in mm:
        parts.append(_item(TAG_MM, struct.pack("<i", offset) + identifier.encode()))
    return b"".join(parts)


def hash_block(parent: bytes, token_bytes: bytes, extra: bytes = b"") -> bytes:
    """One link of the chain; ``token_bytes`` already little-endian uint32."""
    if extra:
        return sha256(parent + struct.pack("<I", len(extra)) + extra + token_bytes).digest()
    return sha256(parent + _NO_EXTRA + token_bytes).digest()


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    *,
    parent: bytes = SEED,
    first_block: int = 0,
    cache_salt: str | None = None,
    lora: str | None = None,
    mm_inputs: Sequence[MMInput] = (),
) -> list[bytes]:
    """Hashes of every full block of ``tokens``.

    ``tokens`` starts at block ``first_block`` of the sequence and ``parent`` is the hash of the
    block before it (SEED for block 0), so a caller can continue a chain incrementally.
    """
    arr = _u32le(tokens)  # one buffer for the whole prompt
    step = block_size * 4
    out: list[bytes] = []
    if cache_salt is None and lora is None and not mm_inputs:  # the common case: no extra keys
        # Copying a fresh state skips OpenSSL's algorithm fetch that sha256() does on each call,
        # three updates skip two concatenations, and iter_unpack cuts the blocks in C: about 12%
        # of the hashing on the reference trace.
        del arr[len(arr) // block_size * block_size :]  # the partial last block is not hashed
        new, append, no_extra = _EMPTY.copy, out.append, _NO_EXTRA
        for (block,) in iter_unpack(f"{step}s", arr):
            h = new()
            h.update(parent)
            h.update(no_extra)
            h.update(block)
            parent = h.digest()
            append(parent)
        return out
    data = arr.tobytes()
    end = len(tokens) // block_size * step
    for i in range(0, end, step):
        extra = extra_keys(first_block + i // step, block_size, cache_salt, lora, mm_inputs)
        parent = hash_block(parent, data[i : i + step], extra)
        out.append(parent)
    return out


class BlockHasher:
    """Incremental hashes of one request: appending tokens hashes only blocks that became full."""

    def __init__(
        self,
        block_size: int,
        cache_salt: str | None = None,
        lora: str | None = None,
        mm_inputs: Sequence[MMInput] = (),
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.cache_salt, self.lora, self.mm_inputs = cache_salt, lora, tuple(mm_inputs)
        self.hashes: list[bytes] = []
        self._pending: list[int] = []  # tokens of the current partial block

    def append(self, tokens: Sequence[int]) -> list[bytes]:
        """Adds tokens; returns the hashes of the blocks they completed."""
        self._pending.extend(tokens)
        n_full = len(self._pending) // self.block_size
        if n_full == 0:
            return []
        cut = n_full * self.block_size
        new = hash_blocks(
            self._pending[:cut],
            self.block_size,
            parent=self.hashes[-1] if self.hashes else SEED,
            first_block=len(self.hashes),
            cache_salt=self.cache_salt,
            lora=self.lora,
            mm_inputs=self.mm_inputs,
        )
        del self._pending[:cut]
        self.hashes.extend(new)
        return new
