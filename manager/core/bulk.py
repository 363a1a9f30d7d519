"""Bulk work over million-entry lists in bounded pieces, so that other threads keep running.

A call that runs in C from start to end (``set(order)``, ``all(map(...))``, ``arr.tolist()``)
never lets the interpreter switch threads: over a 4M-block pool one such call held the GIL for
0.3-1.4 s on a slow core, and the thread that renews the store's lease while a state loads
(manager/store/lease.py) missed its turn, so a standby took the lease from a manager that was
alive and loading. The loader's bulk work goes through these helpers instead: each piece of
``PIECE`` entries still runs in C (a few ms), and the interpreter can switch between pieces.
"""

from __future__ import annotations

import re
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, islice
from typing import TypeVar

T = TypeVar("T")

PIECE = 1 << 16  # entries per C-level call: ~3-6 ms on a slow core


def pieces(items: Iterable[T]) -> Iterator[list[T]]:
    """The items in lists of at most ``PIECE``, each built in one C call."""
    if type(items) is list:  # slicing is cheaper than islice and keeps the order
        for i in range(0, len(items), PIECE):
            yield items[i : i + PIECE]
        return
    it = iter(items)
    while part := list(islice(it, PIECE)):
        yield part


def bulk_list(items: Iterable[T]) -> list[T]:
    """``list(items)``, built piece by piece."""
    out: list[T] = []
    for part in pieces(items):
        out += part
    return out


def truthy_at(items: list[object]) -> list[int]:
    """The indices of the true items, piece by piece (``compress`` over a mostly false list
    would scan all of it in one call to fill one piece)."""
    out: list[int] = []
    for i in range(0, len(items), PIECE):
        out += compress(range(i, i + PIECE), items[i : i + PIECE])
    return out


def bulk_all(items: Iterable[object]) -> bool:
    """``all(items)``, piece by piece (stops at the first piece with a false item)."""
    return all(all(part) for part in pieces(items))


def bulk_min(items: list[int]) -> int:
    """``min(items)`` of a non-empty list, piece by piece."""
    return min(min(part) for part in pieces(items))


def bulk_max(items: list[int]) -> int:
    """``max(items)`` of a non-empty list, piece by piece."""
    return max(max(part) for part in pieces(items))


def bulk_store(target: list[T], at: Sequence[int], values: Sequence[T]) -> None:
    """``target[at[i]] = values[i]`` for every i (as long as the shorter), piece by piece."""
    store = target.__setitem__
    for i in range(0, min(len(at), len(values)), PIECE):
        deque(map(store, at[i : i + PIECE], values[i : i + PIECE]), maxlen=0)  # the loop runs in C


def marks(n: int, ids: Sequence[int]) -> bytearray:
    """``n`` bytes, 1 at each of ``ids`` (each in ``range(n)``; IndexError past it) and 0 elsewhere:
    the ids are distinct exactly when ``marks(n, ids).count(1) == len(ids)``. A set of 4M ids
    resizes in one C call (0.1-0.3 s); the bytes never resize and compare in one memcmp."""
    out = bytearray(n)
    bulk_store(out, ids, b"\x01" * len(ids))
    return out


def array_to_list(arr: array) -> list[int]:
    """``arr.tolist()``, piece by piece."""
    out: list[int] = []
    for i in range(0, len(arr), PIECE):
        out += arr[i : i + PIECE].tolist()
    return out


def split_every(data: bytes, size: int) -> list[bytes]:
    """``data`` cut into ``size``-byte strings (its length a multiple of ``size``), piece by piece."""
    run = re.compile(b".{%d}" % size, re.S)  # compiled once and cached by re
    out: list[bytes] = []
    step = PIECE * size
    for i in range(0, len(data), step):
        out += run.findall(data, i, i + step)  # the slicing runs in C
    return out
