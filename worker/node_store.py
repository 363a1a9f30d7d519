"""The node tier's bytes: a shared host-memory level and a disk level, every block checksummed.

The manager keeps the bookkeeping (manager/core/node_tier.py) and never touches these bytes;
every worker of one layout (and later vLLM through kvpool's connector) opens the same store:

  * ``HostStore``: one file under ``/dev/shm`` (or a configured directory), ``num_slots`` slots
    mapped ``MAP_SHARED`` by every process of the layout, so a block one worker saved is loaded
    by another without a copy through the manager;
  * ``DiskStore``: one file per slot under ``directory/<layout>/``, at most as many slots as the
    byte budget holds (``disk_slots``).

A slot is a 64-byte header (node_layout.py: magic, commit word, length, checksum, layout id, key)
and the block's bytes ``[layers, 2, block_size, heads, head_size]`` of the layout's dtype. The
checksum (xxh3-64, node_layout.py says why) covers the layout id, the key (the block hash) and
the bytes. A read copies the slot into the caller's buffer, then checks the header and the
checksum of *that copy* (so bytes changed after the check are not what was checked); anything
wrong (a missing file, a short read, an uncommitted or torn slot, another layout's or another
key's block, a checksum mismatch) is returned as a ``Failure`` and the buffer is zeroed: no
caller ever holds unverified bytes as if they were K/V. The caller recomputes the block and
reports the order failed, so the manager drops the hash.

A writer that dies mid-save leaves nothing loadable as whole: host slots are un-committed before
their bytes change and committed (the commit word, written last) after; disk slots are written
to a temporary name, fsynced, and renamed over the slot's file, so a slot's file is always a
whole earlier block or absent.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import torch

from kvpool.shared.node_tier import disk_slots as shared_disk_slots
from kvpool.shared.node_tier import host_file, host_stride
from kvpool.worker.node_layout import (
    COMMIT,
    HEADER,
    MAGIC,
    VERSION,
    Failure,
    NodeStoreError,
    StoreLayout,
    check_header,
    checksum,
)

_COMMIT_AT = 8  # byte offset of the commit word in the header (after magic, version, flags)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _poison(out: np.ndarray) -> None:
    out.fill(0)


class HostStore:
    """The shared host-memory level of one layout."""

    def __init__(self, layout: StoreLayout, num_slots: int, directory: str | os.PathLike = "/dev/shm") -> None:
        if num_slots < 2:
            raise NodeStoreError(f"a host store needs at least 2 slots (slot 0 is never used), got {num_slots}")
        self.layout, self.num_slots = layout, num_slots
        self.stride = host_stride(layout.block_bytes)
        self.path = Path(host_file(str(directory), layout.name))
        size = num_slots * self.stride
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            if have == 0:
                os.ftruncate(fd, size)  # zeros: every slot uncommitted; two creators agree on the size
            elif have != size:
                raise NodeStoreError(f"{self.path} holds {have} bytes but {num_slots} slots of this layout take "
                                     f"{size}: another configuration uses it; give the same slot count or remove it")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # numpy views for the copies: a plain memcpy on the calling thread (torch's ``copy_``
        # into a mapped buffer went through its thread pool: 100x slower on a loaded machine)
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)

    def _offset(self, slot: int) -> int | None:
        return slot * self.stride if 0 < slot < self.num_slots else None

    def write(self, slot: int, key: bytes, block: torch.Tensor) -> Failure | None:
        """Stores ``block`` under ``key`` in ``slot``; a Failure only for a slot out of range."""
        data = self.layout.as_bytes(block)
        off = self._offset(slot)
        if off is None:
            return Failure("bad_slot", f"host slot {slot} is outside [1, {self.num_slots})")
        mm = self._mm
        struct.pack_into("<I", mm, off + _COMMIT_AT, 0)  # un-committed before the bytes change
        n = data.size
        np.copyto(self._bytes[off + HEADER.size : off + HEADER.size + n], data)
        HEADER.pack_into(mm, off, MAGIC, VERSION, 0, 0, n, checksum(self.layout.layout_id, key, data),
                         self.layout.layout_id, key)
        struct.pack_into("<I", mm, off + _COMMIT_AT, COMMIT)  # last: the slot is whole
        return None

    def read_into(self, slot: int, key: bytes, out: torch.Tensor) -> Failure | None:
        """The block ``key`` names from ``slot`` into ``out``, verified; else a Failure and
        ``out`` zeroed."""
        dst = self.layout.as_bytes(out)
        off = self._offset(slot)
        if off is None:
            _poison(dst)
            return Failure("bad_slot", f"host slot {slot} is outside [1, {self.num_slots})")
        header = HEADER.unpack_from(self._mm, off)
        n = dst.size
        np.copyto(dst, self._bytes[off + HEADER.size : off + HEADER.size + n])
        failure = check_header(header, self.layout, key, n) or self._verify(header, key, dst)
        if failure is not None:
            _poison(dst)
        return failure

    def _verify(self, header: tuple, key: bytes, data: np.ndarray) -> Failure | None:
        got = checksum(self.layout.layout_id, key, data)
        return None if got == header[5] else Failure("mismatch", f"checksum {got:#x}, header says {header[5]:#x}")

    def close(self) -> None:
        del self._bytes
        self._mm.close()

    def unlink(self) -> None:
        """Removes the segment's file (the last process of the layout, or a test)."""
        self.path.unlink(missing_ok=True)


def disk_slots(layout: StoreLayout, budget_bytes: int) -> int:
    """The disk level's slot count for a byte budget (slot 0 is never a file): what the
    manager's disk level is sized by (shared/node_tier.py), so both sides agree."""
    return shared_disk_slots(layout.block_bytes, budget_bytes)


class DiskStore:
    """The disk level of one layout: ``directory/<layout>/<slot>.kv``, within ``budget_bytes``."""

    def __init__(self, layout: StoreLayout, directory: str | os.PathLike, budget_bytes: int,
                 fsync: bool = True) -> None:
        self.layout, self.fsync = layout, fsync
        self.file_bytes = HEADER.size + layout.block_bytes
        self.num_slots = disk_slots(layout, budget_bytes)
        if self.num_slots < 2:
            raise NodeStoreError(f"a disk budget of {budget_bytes} bytes holds no block of {self.file_bytes} bytes")
        self.dir = Path(directory) / layout.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._tmp = itertools.count()

    def path(self, slot: int) -> Path:
        return self.dir / f"{slot:010d}.kv"

    def write(self, slot: int, key: bytes, block: torch.Tensor) -> Failure | None:
        """Stores ``block`` under ``key`` as ``slot``'s file: a Failure for a slot beyond the
        budget, a full file system or another I/O error (the slot's earlier file, if any, stays)."""
        data = self.layout.as_bytes(block)
        if not 0 < slot < self.num_slots:
            return Failure("full", f"disk slot {slot} is beyond the budget's {self.num_slots - 1} slots")
        header = HEADER.pack(MAGIC, VERSION, 0, COMMIT, data.size,
                             checksum(self.layout.layout_id, key, data), self.layout.layout_id, key)
        tmp = self.dir / f".{slot:010d}.{os.getpid()}.{next(self._tmp)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, header)
                _write_all(fd, memoryview(data))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path(slot))  # the commit: the slot's file is whole or the old one
        except OSError as e:
            tmp.unlink(missing_ok=True)
            kind = "full" if e.errno in _FULL else "io_error"
            return Failure(kind, f"writing disk slot {slot}: {e}")
        return None

    def read_into(self, slot: int, key: bytes, out: torch.Tensor) -> Failure | None:
        """The block ``key`` names from ``slot``'s file into ``out``, verified; else a Failure
        and ``out`` zeroed."""
        dst = self.layout.as_bytes(out)
        failure = self._read(slot, key, dst)
        if failure is not None:
            _poison(dst)
        return failure

    def _read(self, slot: int, key: bytes, dst: np.ndarray) -> Failure | None:
        try:
            with open(self.path(slot), "rb", buffering=0) as f:
                raw = f.read(HEADER.size)
                if len(raw) < HEADER.size:
                    return Failure("short_read", f"disk slot {slot}: {len(raw)} header bytes")
                header = HEADER.unpack(raw)
                n = dst.size
                got = f.readinto(memoryview(dst))
                if got != n or f.read(1):
                    return Failure("short_read", f"disk slot {slot}: {got} of {n} bytes, or more than that")
        except FileNotFoundError:
            return Failure("missing", f"disk slot {slot}: no file {self.path(slot)}")
        except OSError as e:
            return Failure("io_error", f"disk slot {slot}: {e}")
        failure = check_header(header, self.layout, key, n)
        if failure is not None:
            return failure
        sum_ = checksum(self.layout.layout_id, key, dst)
        return None if sum_ == header[5] else Failure("mismatch", f"disk slot {slot}: checksum {sum_:#x}, "
                                                                 f"header says {header[5]:#x}")

    def remove(self, slot: int) -> None:
        self.path(slot).unlink(missing_ok=True)

    def bytes_used(self) -> int:
        """Bytes of this layout's files now (a scan: stats, not the write path)."""
        return sum(e.stat().st_size for e in os.scandir(self.dir) if e.is_file())

    def remove_temps(self) -> int:
        """Removes temporary files left by writers that died (call when no writer runs)."""
        n = 0
        for e in os.scandir(self.dir):
            if e.name.endswith(".tmp"):
                os.unlink(e.path)
                n += 1
        return n


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


__all__ = ["DiskStore", "Failure", "HostStore", "NodeStoreError", "StoreLayout", "disk_slots"]
