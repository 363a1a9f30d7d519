"""vLLM's own block pool (``vllm.v1.core.block_pool``, with ``kv_cache_utils``'s
``KVCacheBlock`` and ``FreeKVCacheBlockQueue``), loaded from a vLLM wheel's source files without
the rest of vLLM.

Importing ``vllm`` runs its ``__init__`` (torch patches, platform detection, ``packaging``,
``psutil``...), and ``vllm.distributed`` sets up process groups: none of it concerns the block
pool, and this environment lacks some of it. So the two files are executed UNMODIFIED as the
modules ``vllm.v1.core.kv_cache_utils`` and ``vllm.v1.core.block_pool``; every other name they
import from ``vllm`` is a placeholder class named after it, which raises if anything instantiates
or calls it (so a code path that did need it would fail loudly, not compute something else).
Only ``vllm.logger.init_logger`` is given a working stand-in (``logging.getLogger``), because
both modules call it at import time. The placeholders live in ``sys.modules`` only while the two
files execute.
"""

from __future__ import annotations

import ast
import logging
import sys
import types
from pathlib import Path
from typing import Any

REAL = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool")


def _placeholder(module: str, name: str) -> type:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise RuntimeError(f"{module}.{name} is not loaded: the block-pool test reached code outside the pool")

    return type(name, (), {"__init__": refuse, "__module__": module})


def _provided(imports: dict[str, set[str]]) -> dict[str, types.ModuleType]:
    """A module for each ``vllm`` module the real files import (and each package above it)."""
    mods: dict[str, types.ModuleType] = {}
    for name, names in imports.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            pkg = ".".join(parts[:i])
            if pkg not in mods:
                mods[pkg] = types.ModuleType(pkg)
                mods[pkg].__path__ = []  # a package, so submodules resolve
        for n in names:
            if name == "vllm" and n == "envs":
                continue  # a submodule, below
            setattr(mods[name], n, _placeholder(name, n))
    mods["vllm.logger"].init_logger = logging.getLogger  # type: ignore[attr-defined]
    if "vllm.envs" in mods:
        mods["vllm"].envs = mods["vllm.envs"]  # type: ignore[attr-defined]
    return mods


def _vllm_imports(sources: list[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                if node.module not in REAL:
                    out.setdefault(node.module, set()).update(a.name for a in node.names)
    out.setdefault("vllm.envs", set())
    out.setdefault("vllm.logger", set())
    return out


def load_vllm_block_pool(tree: Path) -> types.SimpleNamespace:
    """``BlockPool``, ``KVCacheBlock``, ``FreeKVCacheBlockQueue`` and
    ``make_block_hash_with_group_id`` from the extracted wheel ``tree`` (``vllm_tree``)."""
    files = [tree / (m.replace(".", "/") + ".py") for m in REAL]
    sources = [f.read_text() for f in files]
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    try:
        sys.modules.update(_provided(_vllm_imports(sources)))
        loaded = {}
        for name, f, src in zip(REAL, files, sources):
            mod = types.ModuleType(name)
            mod.__file__ = str(f)
            sys.modules[name] = mod
            exec(compile(src, str(f), "exec"), mod.__dict__)  # noqa: S102  vLLM's file, unmodified
            loaded[name] = mod
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    utils, pool = loaded["vllm.v1.core.kv_cache_utils"], loaded["vllm.v1.core.block_pool"]
    return types.SimpleNamespace(BlockPool=pool.BlockPool, KVCacheBlock=utils.KVCacheBlock,
                                 FreeKVCacheBlockQueue=utils.FreeKVCacheBlockQueue,
                                 make_block_hash_with_group_id=utils.make_block_hash_with_group_id,
                                 get_block_hash=utils.get_block_hash)
