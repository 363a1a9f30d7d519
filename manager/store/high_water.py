"""The highest commit sequence this host acknowledged, kept where an older Redis cannot undo it.

A durable manager numbers its commits (``seq``, manager/store/journal.py) and puts the number in
every reply (PROTOCOL.md section 11). If Redis later holds a state whose ``seq`` is lower (an
operator restored yesterday's RDB, Sentinel promoted a lagging replica, an async manager was
killed before its writer caught up), the replies a client already got describe a future that
the store forgot. The manager must then not serve that state as the same one.

The store remembers the highest ``(state_id, seq)`` it acknowledged in memory and in this small
local file, rewritten in place each iteration before replies go out (one ``pwrite``; the page
cache survives a killed process, so no fsync). A manager that restarts on the same host reads it
back before serving. Layout: 40 bytes, ``state_id`` as 32 ASCII hex characters (padded with
spaces) then ``seq`` as u64le. A missing, short or foreign file means "nothing known".
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass

from kvpool.shared.bind import check_private_dir, runtime_dir

logger = logging.getLogger(__name__)
_SEQ = struct.Struct("<Q")
_ID = 32
SIZE = _ID + _SEQ.size


@dataclass(frozen=True)
class Mark:
    state_id: str
    seq: int


class HighWater:
    """``note`` the acknowledged mark every iteration; ``read`` it back at start-up."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fd: int | None = None
        self._last: Mark | None = None

    def read(self) -> Mark | None:
        if not self.path:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as fh:
                data = fh.read(SIZE + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("cannot read the high-water mark %s: %s; nothing is known of earlier acks", self.path, e)
            return None
        if len(data) != SIZE:
            return None
        try:
            state_id = data[:_ID].decode("ascii").rstrip()
        except UnicodeDecodeError:
            return None
        return Mark(state_id, _SEQ.unpack(data[_ID:])[0]) if state_id else None

    def note(self, state_id: str, seq: int) -> None:
        """Records ``(state_id, seq)`` as acknowledged (before the replies that carry it go out)."""
        mark = Mark(state_id, seq)
        if mark == self._last or not self.path:
            return
        if self._fd is None:
            self._fd = self._open()
        head = state_id.encode("ascii", "replace")[:_ID].ljust(_ID)
        os.pwrite(self._fd, head + _SEQ.pack(seq), 0)
        self._last = mark

    def _open(self) -> int:
        directory = os.path.dirname(self.path) or "."  # type: ignore[arg-type]
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.path.abspath(directory) == os.path.abspath(runtime_dir()):
            check_private_dir(directory)  # /tmp/kvpool-UID: nobody else may have planted it
        # O_NOFOLLOW: a link planted at the path must not redirect this write to another file
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # type: ignore[arg-type]
        os.ftruncate(fd, SIZE)
        return fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def start_over_reason(state_id: str, seq: int, known: list[Mark | None], clean: int | None,
                      durability: str) -> str | None:
    """Why the loaded state (``state_id`` at batch ``seq``) must not be served as itself, or None.

    ``known``: marks this manager acknowledged (its memory, its host's file); ``clean``: the
    batch a manager stopped cleanly at (RELEASE), if any. Sync commits before replying, so only
    a store that went back in time is refused. Async replies first: unless this host's mark or
    a clean stop proves that nothing past ``seq`` was acknowledged, acks may be lost.
    """
    mine = [m.seq for m in known if m is not None and m.state_id == state_id]
    if mine and max(mine) > seq:
        return (f"the store holds batch {seq} of state {state_id}, but batch {max(mine)} was acknowledged "
                "(Redis restored from an older copy, a lagging replica promoted, or async writes lost)")
    if durability == "async" and seq not in mine and clean != seq:
        return (f"async durability: the last manager of state {state_id} stopped without a clean shutdown and no "
                f"mark on this host shows what it acknowledged past batch {seq}")
    return None
