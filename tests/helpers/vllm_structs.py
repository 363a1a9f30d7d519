"""vLLM's KV-event structs, declared as vLLM declares them (vllm/distributed/kv_events.py), so a
test decodes kvpool's payloads the way a vLLM-built subscriber does.

``V033``: vLLM 0.33.0 (events are tagged maps, ``omit_defaults``). ``V011``: vLLM 0.11.0 (events
are tagged arrays), kvpool's ``vllm-0.11`` format. Field names, types, defaults and struct
options follow each release's source exactly; ``ExternalBlockHash`` is ``bytes | int`` in both.
``load_vllm_structs`` loads the struct classes of a real vLLM wheel instead (tests that need it
download the wheel once).
"""

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = bytes | int


def _v033() -> SimpleNamespace:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: list[list[int]] | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared, version="0.33.0")


def _v011() -> SimpleNamespace:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared, version="0.11.0")


V033 = _v033()
V011 = _v011()

# -- the real vLLM wheel ---------------------------------------------------------------------

STRUCTS = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")
CACHE = Path(os.environ.get("KVPOOL_TEST_CACHE", Path.home() / ".cache" / "kvpool-tests"))


def vllm_tree(version: str) -> Path | None:
    """The ``vllm/`` package tree (its .py files) of the vLLM ``version`` wheel, extracted once
    under CACHE; the wheel is fetched with ``pip download --no-deps`` and deleted after (None
    when that fails: no index)."""
    where = CACHE / f"vllm-{version}"
    tree = where / "tree"
    if (tree / "vllm" / "__init__.py").is_file():
        return tree
    where.mkdir(parents=True, exist_ok=True)
    try:  # well inside pytest's 300 s per test
        fetch = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(where),
                                f"vllm=={version}"], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return None
    wheels = sorted(where.glob("vllm-*.whl"))
    if fetch.returncode != 0 or not wheels:
        return None
    partial = where / "tree.partial"  # renamed into place when complete: a killed run leaves no half tree
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(partial, [m for m in z.namelist() if m.startswith("vllm/") and m.endswith(".py")])
    partial.rename(tree)
    wheels[0].unlink()
    return tree


def vllm_sources(version: str) -> tuple[str, str] | None:
    """(kv_events.py, kv_cache_utils.py) of the vLLM ``version`` wheel (``vllm_tree``)."""
    tree = vllm_tree(version)
    if tree is None:
        return None
    return ((tree / "vllm/distributed/kv_events.py").read_text(),
            (tree / "vllm/v1/core/kv_cache_utils.py").read_text())


def load_vllm_structs(kv_events_src: str, kv_cache_utils_src: str) -> SimpleNamespace:
    """vLLM's own struct classes: their class statements from kv_events.py (and the
    ExternalBlockHash alias from kv_cache_utils.py), executed unmodified, without the rest of vLLM
    (whose imports need vLLM's whole dependency tree)."""
    alias = [n for n in ast.parse(kv_cache_utils_src).body
             if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "ExternalBlockHash"]
    classes = [n for n in ast.parse(kv_events_src).body if isinstance(n, ast.ClassDef) and n.name in STRUCTS]
    if len(alias) != 1 or [c.name for c in classes] != list(STRUCTS):
        raise AssertionError(f"vLLM's sources no longer declare {STRUCTS} and ExternalBlockHash as expected")
    ns: dict[str, Any] = {"msgspec": msgspec, "Any": Any, "TypeAlias": TypeAlias, "__name__": "vllm_kv_events"}
    for source, nodes in ((kv_cache_utils_src, alias), (kv_events_src, classes)):
        code = "\n\n".join(ast.get_source_segment(source, n) for n in nodes)  # type: ignore[misc]
        exec(compile(code, "vllm/distributed/kv_events.py", "exec"), ns)  # noqa: S102
    return SimpleNamespace(**{name: ns[name] for name in STRUCTS})
