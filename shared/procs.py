"""How a kvpool process starts another kvpool process: the command line and a free TCP port.

- ``CLI``: this interpreter running the ``kvpool`` command (no installed entry point needed),
  the prefix of every child's command line (tensor-parallel ranks, local clusters, tests).
- ``free_port()``: a port free right now on 127.0.0.1; the child binds it a moment later.
"""

from __future__ import annotations

import socket
import sys

# -P: the child's working directory is not put on its sys.path. In a checkout, the repository
# root holds kvpool's subpackages under their short names, and its kernels/ would shadow Hugging
# Face's `kernels` distribution, which transformers 5.25 imports (tests/conftest.py)
CLI = [sys.executable, "-P", "-c", "import sys; from kvpool.cli.main import cli; sys.exit(cli())"]


def free_port() -> int:
    """A port free right now on 127.0.0.1 (whoever is handed it binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
