"""`kvpool worker --tp-size N` without `--tp-rank`: start every rank of one replica here.

The launcher picks a free local port for the process group, starts rank 0..N-1 as child
processes (the same command line plus ``--tp-rank R --tp-master 127.0.0.1:PORT``), forwards
SIGTERM/SIGINT to rank 0 (which frees at the manager, deregisters and tells the others to stop)
and exits when they have. One rank exiting ends the replica: rank 0 stops when a follower is
gone and the followers stop when rank 0 is; whatever is still running after ``grace_s`` is
terminated. The exit status is the first failing rank's (0 when all stopped cleanly).
Children die with the launcher (PR_SET_PDEATHSIG on Linux). No torch import here.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import time

from kvpool.shared.procs import CLI, free_port

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: children outlive a killed launcher


def start_ranks(args: list[str], tp_size: int, master: str) -> list[subprocess.Popen]:
    """Rank processes running ``kvpool <args> --tp-rank R --tp-master MASTER``, in their own
    session (a terminal's Ctrl-C reaches the launcher only, which tells rank 0)."""
    return [subprocess.Popen([*CLI, *args, "--tp-rank", str(rank), "--tp-master", master],
                             start_new_session=True, preexec_fn=_die_with_parent)
            for rank in range(tp_size)]


def supervise(procs: list[subprocess.Popen], grace_s: float = 15.0, poll_s: float = 0.2) -> int:
    """Waits for the ranks; returns the exit status of the replica (see the module docstring)."""
    stop = {"asked": False}

    def forward(signum: int, _frame: object) -> None:
        stop["asked"] = True
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while all(p.poll() is None for p in procs):
        time.sleep(poll_s)
    first = next(r for r, p in enumerate(procs) if p.returncode is not None)
    if procs[first].returncode != 0 and not stop["asked"]:
        logger.error("tensor-parallel rank %d exited with %s: stopping the replica", first, procs[first].returncode)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(poll_s)
    for rank, p in enumerate(procs):
        if p.poll() is None:
            logger.error("tensor-parallel rank %d did not stop in %.0fs: killing it", rank, grace_s)
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    failed = [c for c in codes if c != 0]
    return 0 if not failed else (failed[0] if failed[0] > 0 else 128 - failed[0])


def launch(args: list[str], tp_size: int) -> int:
    """Starts and supervises every rank of one replica; returns its exit status."""
    master = f"127.0.0.1:{free_port()}"
    logger.info("starting %d tensor-parallel ranks (process group at %s)", tp_size, master)
    return supervise(start_ranks(args, tp_size, master))
