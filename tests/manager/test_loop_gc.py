"""The manager loop's own garbage collections: idle ones at most every GC_EVERY_S, counted and
timed in stats, so a tail that a collection causes shows up there."""

from __future__ import annotations

import gc
import time

from helpers.durable import CaptureStore, durable_server
from helpers.manager import call, hello, make_server

from kvpool.manager import timers as timers_mod


def test_idle_collections_are_spaced_counted_and_timed(monkeypatch):
    srv = make_server()
    clock = [10.0]  # the loop has run for 10 s
    monkeypatch.setattr(timers_mod.time, "monotonic", lambda: clock[0])
    srv._maybe_gc(idle=False)  # busy: no collection before 10 * GC_EVERY_S without an idle iteration
    srv._maybe_gc(idle=True)
    srv._maybe_gc(idle=True)  # within GC_EVERY_S of the last one
    gc_stats = srv.stats.snapshot()["gc"]
    assert gc_stats["collections"] == 1 and 0 < gc_stats["max_s"] == gc_stats["seconds"]
    clock[0] += timers_mod.GC_EVERY_S
    srv._maybe_gc(idle=False)  # due, but busy: waits for an idle iteration
    assert srv.stats.gc_collections == 1
    clock[0] += 9 * timers_mod.GC_EVERY_S
    srv._maybe_gc(idle=False)  # never idle for 10x as long: collected all the same
    assert srv.stats.gc_collections == 2 and srv.stats.gc_s >= srv.stats.gc_max_s
    assert time.monotonic() == clock[0]  # the patch held: the spacing above was the loop's own


def test_stats_report_the_frozen_count_taken_at_freeze_time_and_never_walk_it(monkeypatch):
    """gc.get_freeze_count() walks every frozen object (tens of ms under a 1M-block state): the
    count is taken once when a loaded state is frozen, and the stats op only reports it."""
    srv = durable_server(store=CaptureStore())  # activation loads the store, then freezes the heap
    frozen = srv.stats.frozen
    assert frozen > 1000

    def walk():
        raise AssertionError("the stats op walked the frozen heap")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert srv.stats.snapshot()["gc"]["frozen"] == frozen
    assert call(srv, "stats", hello(srv))["body"]["manager"]["gc"]["frozen"] == frozen
