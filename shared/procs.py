"""How a kvpool process starts another kvpool process: the command line and a free TCP port.

- ``CLI``: this interpreter running the ``kvpool`` command (no installed entry point needed),
  the prefix of every child's command line (tensor-parallel ranks, local clusters, tests).
- ``free_port()``: a port free right now on 127.0.0.1, below the kernel's ephemeral range; the
  child binds it a moment later.
"""

from __future__ import annotations

import random
import socket
import sys

# -P: the child's working directory is not put on its sys.path. In a checkout, the repository
# root holds kvpool's subpackages under their short names, and its kernels/ would shadow Hugging
# Face's `kernels` distribution, which transformers 5.25 imports (tests/conftest.py)
CLI = [sys.executable, "-P", "-c", "import sys; from kvpool.cli.main import cli; sys.exit(cli())"]


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # free_port picks from here up to the kernel's ephemeral range


def free_port() -> int:
    """A port free right now on 127.0.0.1 (whoever is handed it binds it a moment later), picked
    below the kernel's ephemeral range: a port the kernel handed out for ``bind(0)`` would be
    handed out again, to any process's ``bind(0)`` or outgoing connection, in the moment before
    its owner binds it (two vLLM servers starting together lost their API port that way: each
    opens many sockets on ports the kernel picks). Where the range leaves no room below it, the
    kernel's pick."""
    rng = random.SystemRandom()  # not the random module's state: tests seed it, children share it
    low = _ephemeral_low()
    for _ in range(100 if low - LOWEST_PORT >= 1000 else 0):
        port = rng.randrange(LOWEST_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
