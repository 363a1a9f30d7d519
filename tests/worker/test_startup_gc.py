"""A worker moves its start-up heap out of the garbage collector's sight before it serves
(worker/startup.py freeze_start_up_heap), on rank 0 and on tensor-parallel followers."""

from __future__ import annotations

import gc

import pytest

from kvpool.worker import startup
from kvpool.worker.config import PRESETS, WorkerConfig


def test_freeze_takes_what_lives_now_out_of_the_collections():
    class Node:  # a cycle-capable object the collector tracks
        pass

    before = Node()
    try:
        frozen = startup.freeze_start_up_heap()
        after = Node()
        tracked = {id(o) for o in gc.get_objects()}
        assert frozen == gc.get_freeze_count() > 0
        assert id(before) not in tracked and id(after) in tracked
    finally:
        gc.unfreeze()  # the test process goes on collecting as before


@pytest.mark.parametrize("rank", [0, 1])
def test_serve_rank_freezes_after_start_up_and_before_serving(monkeypatch, rank):
    calls: list[str] = []

    class Served:
        def __init__(self, *a, **k) -> None:
            calls.append("built")

        def serve(self) -> None:
            calls.append("serve")

        def run(self) -> None:
            calls.append("serve")

    monkeypatch.setattr(startup, "RemoteBlockManager", lambda *a, **k: object())
    monkeypatch.setattr(startup, "claim", lambda *a: "free")
    monkeypatch.setattr(startup, "build_engine", lambda cfg, bm: calls.append("engine"))
    monkeypatch.setattr(startup, "build_follower", lambda cfg, bm: Served())
    monkeypatch.setattr(startup, "WorkerServer", Served)
    monkeypatch.setattr(startup.WorkerMetrics, "start", staticmethod(lambda cfg: None))
    monkeypatch.setattr(startup, "freeze_start_up_heap", lambda: calls.append("freeze"))
    monkeypatch.setattr(startup, "init_group", lambda *a: None)
    monkeypatch.setattr(startup, "check_tp", lambda *a: None)
    monkeypatch.setattr(startup, "load_config", lambda *a: PRESETS["tiny"])  # the shape only: no weights
    cfg = WorkerConfig(tp_size=2, tp_rank=rank) if rank else WorkerConfig()
    startup.serve_rank(cfg, ["ipc:///tmp/kvpool-unused.sock"], "ipc:///tmp/kvpool-w.sock", "127.0.0.1:1", 1.0)
    assert calls == (["engine", "built", "freeze", "serve"] if rank == 0 else ["built", "freeze", "serve"])
