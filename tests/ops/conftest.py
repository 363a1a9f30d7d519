"""Fixtures for the operations tests: short socket directories and spawned processes (killed at
teardown)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import pytest
from ops_helpers import stop_process


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvo-")  # ipc paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def spawn(args: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(args, **kw)
        started.append(p)
        return p

    yield spawn
    for p in started:
        stop_process(p, timeout=5)
