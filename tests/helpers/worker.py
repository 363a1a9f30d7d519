"""Factories for worker tests: the `tiny` preset in fp32 on CPU, an in-process manager."""

from __future__ import annotations

import random

import torch

from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.config import PRESETS, WorkerConfig
from kvpool.worker.engine import Engine
from kvpool.worker.reference import reference_generate
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.startup import build_engine

TINY = PRESETS["tiny"]
BLOCK_BYTES = 2 * 16 * TINY.num_kv_heads * TINY.head_size * 4 * TINY.num_layers  # fp32, block 16


def make_engine(num_blocks: int = 256, *, max_blocks: int | None = None, caching: bool = True,
                **cfg: object) -> Engine:
    cfg.setdefault("max_model_len", 256)
    wc = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=num_blocks * BLOCK_BYTES,
                      **cfg)  # type: ignore[arg-type]
    return build_engine(wc, LocalBlockManager("test", enable_caching=caching, max_blocks=max_blocks))


def make_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, TINY.vocab_size) for _ in range(n)]  # never EOS (1)


def reference(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    return reference_generate(engine.model, prompt, max_tokens, engine.model.config.eos_token_ids)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n)


def step_tokens(engine: Engine, got: dict[str, list[int]]) -> list:
    """One step; every token it drew appended to ``got[request_id]``. Returns its events."""
    events = engine.step()
    for ev in events:
        if ev.token is not None:
            got.setdefault(ev.request_id, []).append(ev.token)
    return events


def run_dry(engine: Engine, got: dict[str, list[int]]) -> None:
    """Steps until nothing is left, every token drawn into ``got``."""
    while engine.has_work():
        step_tokens(engine, got)


def assert_drained(engine: Engine) -> None:
    """Nothing left to do and every block back at the manager, invariants intact."""
    assert not engine.has_work()
    pool = engine.bm.core
    pool.check_invariants()
    stats = pool.snapshot_stats()
    assert stats["requests"] == 0 and stats["used_blocks"] == 0


def evict_with_others(engine: Engine, n: int = 4, seed: int = 100) -> None:
    """Runs ``n`` unrelated prompts through ``engine``: a small device pool evicts earlier prefixes."""
    engine.generate([make_prompt(48, seed + i) for i in range(n)], greedy(4))


def assert_load_restores_kv(engine: Engine) -> None:
    """A prompt's first three blocks, computed, then evicted by others' work and brought back by a
    host-tier load into other blocks, hold exactly the K/V computed the first time."""
    a = make_prompt(50, 2)
    engine.add_request(a, greedy(2))
    engine.step()  # prefill: blocks 0..2 of a are full and cached
    table = list(engine.scheduler.running[0].block_table[:3])
    computed = [c[:, table].clone() for c in engine.runner.kv_caches]
    while engine.has_work():
        engine.step()
    evict_with_others(engine)  # demotes a's blocks to the host tier
    engine.add_request(a, greedy(2))
    engine.step()  # loads, then the forward pass
    new_table = list(engine.scheduler.running[0].block_table[:3])
    assert engine.bm.core.host.stats.loads > 0 and new_table != table
    for layer, cache in enumerate(engine.runner.kv_caches):
        assert torch.equal(cache[:, new_table], computed[layer])
    while engine.has_work():
        engine.step()
