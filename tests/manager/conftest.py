"""Fixtures for the manager tests: socket directories, live servers, spawned processes.

Sockets live in short temporary directories (ipc paths are limited to 107 bytes); every thread
and process a fixture starts is stopped or killed in its finalizer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

import pytest
from durable_helpers import drop_namespace, new_namespace, redis_or_skip
from manager_helpers import LiveServer


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvp-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def live_server(sock_dir):
    started: list[LiveServer] = []

    def start(**cfg) -> LiveServer:
        s = LiveServer(f"ipc://{sock_dir}/m{len(started)}.sock", **cfg)
        started.append(s)
        return s

    yield start
    for s in started:
        s.server.request_stop()
        s.thread.join(10)


@pytest.fixture
def procs():
    """Spawns processes; kills whatever is still running at teardown."""
    started: list[subprocess.Popen] = []

    def spawn(args: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("text", True)
        p = subprocess.Popen(args, **kw)
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(10)


@pytest.fixture
def namespace():
    """A fresh Redis namespace for a durable manager, deleted afterwards."""
    r = redis_or_skip()
    name = new_namespace()
    yield name
    drop_namespace(r, name)
    r.close()
