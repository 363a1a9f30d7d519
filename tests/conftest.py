"""Fixtures every test folder shares; the helpers themselves live in the ``helpers`` package.

Sockets live in short temporary directories (ipc paths are limited to 107 bytes); every thread
and process a fixture starts is stopped or killed in its finalizer.
"""

import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory, the repository root, first on sys.path. Its
# folders are kvpool's subpackages under their short names (kernels/ is kvpool.kernels), and a
# bare `kernels` there shadows Hugging Face's `kernels` distribution, which transformers 5.25
# requires and imports with its activations: every test that builds a transformers config then
# failed with "cannot import name 'CUDAProperties' from 'kernels'". kvpool is imported as the
# installed `kvpool` package, so the root has no business on the path.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel module is imported, so it is set here, before any
# test module can import one. Only without CUDA: on a GPU the kernels must really compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread, as the worker processes the tests start have (helpers/worker_procs.py):
# the tests' models are tiny, and on a busy 2-core machine OpenMP's spinning threads turned a
# 1.2 s greedy reference (test_chaos.py) into 11-46 s, past pytest's timeout
torch.set_num_threads(1)

import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
from helpers.durable import drop_namespace, new_namespace, redis_or_skip  # noqa: E402
from helpers.manager import LiveServer  # noqa: E402


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvp-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def live_server(sock_dir):
    """Starts Servers looping in threads: ``live_server(**cfg)``; stopped at teardown."""
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
    """Spawns processes (stdout piped, text, unless given); the one kill policy: whatever is
    still running at teardown is SIGKILLed (a test that wants a clean stop uses stop_process)."""
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
