"""Builds the C++ CPU kernels (kernels/csrc/) once per machine and loads them; None where it can't.

One library, ``torch.ops.kvpool_cpu``: the paged attention of paged_attention_cpu.py and the
per-layer ops of layer_ops.py.

The library lands in ``KVPOOL_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/kvpool/kernels``, i.e.
``~/.cache/kvpool/kernels``) under a name keyed by everything it depends on: the source, torch's
version and C++ ABI, the compiler flags and this CPU's feature flags. ``-march=native`` makes code
for the CPU that compiles it, so a cache carried to another CPU builds anew rather than dying of
an illegal instruction. ``scripts/install.sh`` builds it (``cpu_build.main()``)
so a worker does not compile at its first start; a worker that finds it missing builds it then
(under a file lock: concurrent starts compile once). Where no compiler is found, the build fails
or ``KVPOOL_CPU_KERNELS=0`` is set, ``load()`` is False and the dispatcher keeps the torch
reference (logged once).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).resolve().parent / "csrc" / name
                for name in ("paged_attention_cpu.cpp", "layer_ops_cpu.cpp"))
FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-w")
_BUILD_TIMEOUT_S = 600.0


def cache_dir() -> Path:
    """Where built libraries are kept (created on first build)."""
    if os.environ.get("KVPOOL_KERNEL_CACHE"):
        return Path(os.environ["KVPOOL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpool" / "kernels"


def _cpu_flags() -> str:
    """This CPU's feature flags (x86 "flags", Arm "Features"), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def library_path(directory: Path | None = None) -> Path:
    """The library's path for this source, torch, flags and CPU."""
    h = hashlib.sha256()
    for source in (*SOURCES, SOURCES[0].parent / "cpu_math.h"):
        h.update(source.read_bytes())
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join(FLAGS), _cpu_flags()):
        h.update(b"\0" + part.encode())
    return (directory or cache_dir()) / f"kvpool_cpu_{h.hexdigest()[:16]}.so"


def compiler() -> str | None:
    """The C++ compiler: ``KVPOOL_CXX`` or ``CXX`` when set (None when it is not there), else
    g++ or c++ from PATH."""
    explicit = os.environ.get("KVPOOL_CXX") or os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit)
    return shutil.which("g++") or shutil.which("c++")


def _command(cxx: str, target: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    libs = library_paths()
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in include_paths()), *map(str, SOURCES), "-o", str(target),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]


def build(directory: Path | None = None, cxx: str | None = None) -> Path | None:
    """The built library (compiled now when missing), or None: no compiler, or it failed (the
    reason logged)."""
    target = library_path(directory)
    if target.is_file():
        return target
    cxx = cxx or compiler()
    if cxx is None or shutil.which(cxx) is None:
        logger.warning("no C++ compiler (set CXX or KVPOOL_CXX): the CPU kernels keep the torch path")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        logger.info("building the CPU kernels: %s", target)
        try:
            proc = subprocess.run(_command(cxx, Path(tmp)), capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            logger.warning("building the CPU kernels failed (%s): the torch path stays", e)
        if proc is None or proc.returncode != 0:
            if proc is not None:
                logger.warning("building the CPU kernels failed: the torch path stays\n%s",
                               proc.stderr[-3000:])
            Path(tmp).unlink(missing_ok=True)
            return None
        os.replace(tmp, target)  # whole or not at all: a reader never loads a half-written file
    return target


@functools.cache
def load() -> bool:
    """Whether ``torch.ops.kvpool_cpu`` is loaded (built first if needed); False keeps the
    torch reference. Once per process: a library's op namespace can be registered only once."""
    if os.environ.get("KVPOOL_CPU_KERNELS", "1") == "0":
        logger.info("KVPOOL_CPU_KERNELS=0: the CPU kernels keep the torch path")
        return False
    path = build()
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as e:  # a library built against another torch that kept the same version
        logger.warning("could not load %s (%s): the CPU kernels keep the torch path", path, e)
        return False
    return True


def main() -> int:
    """Builds now (scripts/install.sh runs this); 0 either way, since the torch path serves
    without the library."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build()
    print(f"cpu kernels: {path}" if path else "cpu kernels: not built, the torch path serves", file=sys.stderr)
    return 0

