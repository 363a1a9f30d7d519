"""Snapshots written by a forked child, so the loop never stops to serialize a large state.

Dumping and encoding a 1M-block registry takes most of a second of pure Python; done on the
loop it stalled every client that long. Instead the loop ``fork()``s (a few milliseconds: the
kernel shares the pages copy-on-write) and goes on serving; the child holds an immutable view
of the state as it was at batch ``seq``, encodes it, opens its own Redis connection, waits
until the journal reaches ``seq`` (under async the writer thread may still be behind), and runs
the snapshot script, which checks the fencing token and trims exactly the batches the snapshot
includes. Batches the loop commits meanwhile are appended after them, so the journal always
continues the snapshot. The child reports the snapshot's size on a pipe and exits with a status
(``os._exit``: no atexit handlers, no ZeroMQ or logging in the child); the loop reaps it in a
later iteration and only then counts the snapshot as taken. One child at a time.

This is the approach Redis itself takes for BGSAVE. It needs ``os.fork`` (POSIX); without a
way to reconnect to Redis the store snapshots on the loop as before.
"""

from __future__ import annotations

import gc
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)
_SIZE = struct.Struct("<Q")
EXIT_OK, EXIT_FAILED, EXIT_BEHIND = 0, 1, 2
WAIT_FOR_JOURNAL_S = 30.0  # how long a child waits for the async writer to reach its seq


@dataclass
class Child:
    pid: int
    seq: int
    fd: int  # read end of the size pipe
    started: float


@dataclass
class Outcome:
    seq: int
    ok: bool
    size: int
    why: str


def fork_snapshot(encode: Callable[[], bytes], write: Callable[[bytes], None], seq: int) -> Child | None:
    """Forks a child that runs ``write(encode())``, the snapshot at batch ``seq``; None where fork
    is unavailable."""
    if not hasattr(os, "fork"):
        return None
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = EXIT_FAILED
        try:
            os.close(rfd)
            gc.disable()  # the state is acyclic; a collection would only copy pages
            data = encode()
            write(data)
            os.write(wfd, _SIZE.pack(len(data)))
            code = EXIT_OK
        except TimeoutError:
            code = EXIT_BEHIND
        except BaseException:  # noqa: BLE001 - the status says it failed; the loop logs it
            code = EXIT_FAILED
        finally:
            os._exit(code)
    os.close(wfd)
    return Child(pid, seq, rfd, time.monotonic())


def reap(child: Child, block: bool = False) -> Outcome | None:
    """The child's outcome once it exited (None while it runs, unless ``block``)."""
    pid, status = os.waitpid(child.pid, 0 if block else os.WNOHANG)
    if pid == 0:
        return None
    try:
        raw = os.read(child.fd, _SIZE.size)
    finally:
        os.close(child.fd)
    code = os.waitstatus_to_exitcode(status)
    if code == EXIT_OK and len(raw) == _SIZE.size:
        return Outcome(child.seq, True, _SIZE.unpack(raw)[0], "")
    why = {EXIT_BEHIND: "the journal did not reach the snapshot's batch in time"}.get(
        code, f"the snapshot child exited with status {code}")
    return Outcome(child.seq, False, 0, why)


def kill(child: Child) -> None:
    """Stops a child whose snapshot is no longer wanted (the state is being reloaded)."""
    try:
        os.kill(child.pid, 9)
    except ProcessLookupError:
        pass
    reap(child, block=True)


def write_when_journal_ready(client, script_src: str, keys: list[str], args: list) -> None:
    """Runs the snapshot script, retrying while it answers BEHIND (the async writer has not yet
    written the snapshot's batch); TimeoutError after ``WAIT_FOR_JOURNAL_S``."""
    import redis

    script = client.register_script(script_src)
    deadline = time.monotonic() + WAIT_FOR_JOURNAL_S
    while True:
        try:
            script(keys=keys, args=args)
            return
        except redis.ResponseError as e:
            if not str(e).startswith("BEHIND"):
                raise
            if time.monotonic() > deadline:
                raise TimeoutError(str(e)) from None
            time.sleep(0.005)
