"""Starts a ``kvpool manager`` process for the benchmark scripts and waits until it answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvpool.client.manager import ManagerClient
from kvpool.client.retry import RetryPolicy

# The package layout of pyproject.toml ([tool.setuptools.package-dir]): kvpool.X -> folder.
PACKAGE_DIRS = {"kvpool": "api", "kvpool.cli": "cli", "kvpool.shared": "shared", "kvpool.manager": "manager",
                "kvpool.worker": "worker", "kvpool.kernels": "kernels", "kvpool.frontend": "frontend",
                "kvpool.client": "client"}

# Run with `-c` in place of the installed package: kvpool's packages from CHECKOUT (argv[1]),
# found ahead of the editable install, so an older commit's daemon runs beside this one.
_FROM_CHECKOUT = """
import sys
from importlib.util import spec_from_file_location
root, dirs = sys.argv.pop(1), {dirs!r}

class FromCheckout:
    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = dirs.get(name)
        if folder is None:
            return None
        folder = f"{{root}}/{{folder}}"
        return spec_from_file_location(name, f"{{folder}}/__init__.py", submodule_search_locations=[folder])

sys.meta_path.insert(0, FromCheckout)
from kvpool.cli.main import cli
cli()
"""


def start_daemon(endpoint: str, session_timeout_s: int, extra: list[str] | None = None,
                 quiet: bool = False, checkout: str | None = None) -> subprocess.Popen:
    """The daemon on ``endpoint``, once it answers ``hello`` (within 30 s, else RuntimeError).
    ``quiet`` sends its output to /dev/null. ``checkout``: run the code of that source tree
    (another git worktree, e.g. the main branch's) instead of the installed one."""
    if checkout is None:
        head = ["-c", "from kvpool.cli.main import cli; cli()"]
    else:
        root = os.path.abspath(checkout)
        if not os.path.isfile(os.path.join(root, "manager", "server.py")):
            raise RuntimeError(f"{checkout} is not a kvpool checkout (no manager/server.py)")
        head = ["-c", _FROM_CHECKOUT.format(dirs=PACKAGE_DIRS), root]
    cmd = [sys.executable, *head, "manager", "-m", endpoint, "--session-timeout", str(session_timeout_s), *(extra or [])]
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    backoff = RetryPolicy(deadline_s=30, first_pause_s=0.2, max_pause_s=0.2).start()
    while True:
        try:
            with ManagerClient(endpoint, role="admin", timeout_s=1.0) as c:
                c.hello()
            return proc
        except Exception:
            if proc.poll() is not None or backoff.expired():
                proc.kill()
                raise RuntimeError("the manager daemon did not start: try `kvpool manager -m ipc://...`") from None
            time.sleep(backoff.advance())
