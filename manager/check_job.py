"""The `check` admin op on a large state: the invariant check runs in a forked child.

Checking every invariant of a 1M-block state takes seconds block by block (``Pool.check_invariants``)
and half a second in bulk (manager/store/checks.py); on the loop either stalls every client that
long. As snapshots do (manager/store/snapshot_child.py), the loop instead ``fork()``s (a few
milliseconds: the kernel shares the pages copy-on-write) and goes on serving; the child holds
the state exactly as it was when the request was read, checks it in bulk (and each host tier
block by block), writes what it found on a pipe and exits (``os._exit``: no ZeroMQ, no logging
in the child). The loop answers the request once the child has exited; the reply carries the
incarnation, state id and sequence of the moment it was asked, which is the state checked.

One child at a time: requests that arrive while one runs wait for the next child, which checks
the state as it is when it starts (never a state older than the request). A state small enough
(``inline_blocks``) is checked on the loop as before, and so is every state where ``os.fork`` is
missing.
"""

from __future__ import annotations

import gc
import logging
import os
from collections import Counter
from dataclasses import dataclass, field

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.registry import Registry
from kvpool.manager.store.checks import verify_registry
from kvpool.shared.protocol import ManagerError, error_reply, ok_reply

logger = logging.getLogger(__name__)
INLINE_BLOCKS = 8192  # up to this many blocks (all pools, both tiers) the loop checks in ~20 ms itself
MAX_MESSAGE = 2048  # bytes of the child's finding; a pipe takes it without blocking
EXIT_OK, EXIT_BROKEN, EXIT_FAILED = 0, 1, 2


@dataclass(frozen=True)
class Waiter:
    """A `check` request waiting for a child: where its reply goes and what it carries."""

    envelope: tuple[bytes, ...]  # the ROUTER routing frames (and the empty delimiter, if sent)
    msg_id: int
    incarnation: str
    state_id: str
    seq: int | None


@dataclass
class _Child:
    pid: int
    fd: int  # read end of the finding pipe
    waiters: list[Waiter]
    body: dict  # the counts of the state it checks


@dataclass
class CheckJobs:
    """The loop's forked checks: ``add`` a request, ``poll`` every iteration for finished replies."""

    registry: Registry
    errors: Counter
    inline_blocks: int = INLINE_BLOCKS
    children: int = 0  # forked so far (tests, metrics)
    _child: _Child | None = None
    _queued: list[Waiter] = field(default_factory=list)
    _ready: list[list[bytes]] = field(default_factory=list)

    def forks(self) -> bool:
        """Whether a `check` of the current state goes to a child (else the loop runs it)."""
        return hasattr(os, "fork") and total_blocks(self.registry) > self.inline_blocks

    def add(self, waiter: Waiter) -> None:
        self._queued.append(waiter)
        if self._child is None:
            self._start()

    @property
    def running_pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def poll(self) -> list[list[bytes]]:
        """Reply frames of the requests whose child exited (non-blocking); starts the next child."""
        child = self._child
        if child is not None:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
            if pid != 0:
                self._child = None
                self._finish(child, os.waitstatus_to_exitcode(status))
                if self._queued:
                    self._start()
        ready, self._ready = self._ready, []
        return ready

    def _start(self) -> None:
        reg = self.registry
        body = {"pools": len(reg.pools), "sessions": len(reg.sessions), "requests": reg.total_requests()}
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(rfd)
            _child_main(reg, wfd)
        os.close(wfd)
        self.children += 1
        self._child = _Child(pid, rfd, self._queued, body)
        self._queued = []

    def _finish(self, child: _Child, code: int) -> None:
        try:
            finding = os.read(child.fd, MAX_MESSAGE).decode("utf-8", "replace")
        finally:
            os.close(child.fd)
        err = None
        if code == EXIT_BROKEN:
            err = ManagerError("invariant_broken", finding)
            logger.error("check: %s", finding)
        elif code != EXIT_OK:
            err = ManagerError("internal", f"the check's child process failed (exit status {code}): "
                                           f"{finding or 'see the manager log'}")
            logger.error("check: the child exited with status %d: %s", code, finding)
        for w in child.waiters:
            if err is None:
                payload = ok_reply(w.msg_id, w.incarnation, child.body, w.state_id, w.seq)
            else:
                self.errors[err.code] += 1
                payload = error_reply(w.msg_id, w.incarnation, err, w.state_id, w.seq)
            self._ready.append([*w.envelope, payload])

    def close(self) -> None:
        """Stops a running child (the manager is stopping); its requests get no reply."""
        child, self._child = self._child, None
        if child is None:
            return
        try:
            os.kill(child.pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(child.pid, 0)
        os.close(child.fd)


def total_blocks(reg: Registry) -> int:
    n = 0
    for entry in reg.pools.values():
        pool = entry.pool
        if pool is not None:
            n += pool.blocks.num_blocks + (pool.host.blocks.num_blocks if pool.host is not None else 0)
    return n


def check_registry(reg: Registry) -> None:
    """Every invariant ``Registry.check_invariants`` checks, in bulk where it can be: raises
    InvariantBroken naming the first one broken."""
    try:
        verify_registry(reg, "state")
    except CorruptState as e:
        raise InvariantBroken(str(e)) from None
    for entry in reg.pools.values():
        if entry.pool is None:
            continue
        if entry.pool.host is not None:
            entry.pool.host.check_invariants()
        dead = [s.rank for s in entry.shards.values() if s.sid not in reg.sessions]
        if entry.shard_count > 1 and dead:
            raise InvariantBroken(f"pool {entry.name}: ready with shards {dead} whose sessions are gone")


def _child_main(reg: Registry, wfd: int) -> None:
    code, finding = EXIT_FAILED, ""
    try:
        gc.disable()  # the state is acyclic; a collection would only copy pages
        check_registry(reg)
        code = EXIT_OK
    except InvariantBroken as e:
        code, finding = EXIT_BROKEN, str(e)
    except BaseException as e:  # noqa: BLE001 - the status says it failed; the loop logs the text
        finding = f"{type(e).__name__}: {e}"
    finally:
        try:
            os.write(wfd, finding.encode()[:MAX_MESSAGE])
        finally:
            os._exit(code)
