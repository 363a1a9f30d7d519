"""Starts a ``kvpool manager`` process for the benchmark scripts and waits until it answers."""

from __future__ import annotations

import subprocess
import sys
import time

from kvpool.worker.manager_client import ManagerClient


def start_daemon(endpoint: str, session_timeout_s: int, extra: list[str] | None = None,
                 quiet: bool = False) -> subprocess.Popen:
    """The daemon on ``endpoint``, once it answers ``hello`` (within 30 s, else RuntimeError).
    ``quiet`` sends its output to /dev/null."""
    cmd = [sys.executable, "-c", "from kvpool.cli.main import cli; cli()", "manager", "-m", endpoint,
           "--session-timeout", str(session_timeout_s), *(extra or [])]
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    deadline = time.monotonic() + 30
    while True:
        try:
            with ManagerClient(endpoint, role="admin", timeout_s=1.0) as c:
                c.hello()
            return proc
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the manager daemon did not start: try `kvpool manager -m ipc://...`") from None
            time.sleep(0.2)
