#!/usr/bin/env python3
"""Loop pauses of a manager with a large pool: a snapshot, and a restart's recovery.

Builds, through the registry's own (journaled) operations and a real RedisStore, one pool of
``--blocks`` blocks (1M by default) with many live requests and many cached free blocks, lets
the store compact (snapshot) as it would in service, adds a journal tail of ``--tail-steps``
steps after the last snapshot. Then, in the same run, each against the old path:

- snapshot: how long the loop stops. Old: dump + encode + write on the loop. New: the loop
  forks a child that writes it (manager/store/snapshot_child.py); the pause is the fork.
- cold start: read snapshot + journal from Redis, decode, load, replay the tail, check every
  invariant. Old: the per-block Python invariant check with the garbage collector running.
  New: ``recover`` (bulk checks, GC paused). A thread beside it records the longest time it
  waited for its turn (the thread that renews the lease while a state loads waits as long),
  against the same recovery with each bulk step in one call instead of pieces.

    python scripts/bench_recovery.py                      # 1M blocks
    python scripts/bench_recovery.py --blocks 200000 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.manager.config import ManagerConfig
from kvpool.manager.core import bulk
from kvpool.manager.registry import Registry
from kvpool.manager.store.journal import recover, replay
from kvpool.manager.store.redis_store import RedisStore, namespace_keys
from kvpool.manager.store.redis_url import connect
from kvpool.manager.store.state_file import decode_state, dump_registry, load_registry
from kvpool.shared.protocol import KVSpec
from kvpool.shared.step_ops import Alloc, Free, encode_ops

SPEC = {"block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
REQ_BLOCKS = 64  # blocks per request (1024-token prompts)
LEASE_MS = ManagerConfig().lease_ms


def new_registry() -> Registry:
    return Registry("bench", session_timeout_s=60.0, max_blocks=1 << 24)


def alloc(rid: int, rng: random.Random) -> Alloc:
    hashes = [rng.randbytes(32) for _ in range(REQ_BLOCKS - 1)]
    n = REQ_BLOCKS * SPEC["block_size"]
    return Alloc(rid, hashes, n, n)


def build(store: RedisStore, reg: Registry, blocks: int, tail_steps: int, seed: int) -> dict:
    """Fills ~80% of the pool with live requests and ~15% with cached free blocks, journaled."""
    rng = random.Random(seed)
    sess = reg.open_session("bench", "worker", True, 1, 0.0)
    entry = reg.register(sess, "big", 0, 1, "i", KVSpec(**SPEC), blocks * KVSpec.from_wire(SPEC).block_bytes)
    live, rid, msg = [], 0, 0
    target_live, target_cached = int(0.8 * blocks) // REQ_BLOCKS, int(0.15 * blocks) // REQ_BLOCKS
    while len(live) < target_live + target_cached:
        ops = [alloc(rid + k, rng) for k in range(16)]
        msg += 1
        reg.step(sess, entry, encode_ops(ops), msg)
        live += [rid + k for k in range(16)]
        rid += 16
        store.commit(reg, set())
    freed, live = live[:target_cached], live[target_cached:]
    for i in range(0, len(freed), 64):  # the cached free blocks: hashed, in the LRU queue
        msg += 1
        reg.step(sess, entry, encode_ops([Free(r) for r in freed[i:i + 64]]), msg)
        store.commit(reg, set())
    store.compact(reg)
    for _ in range(tail_steps):  # the journal tail: frees and new allocations after the snapshot
        victims = [live.pop(rng.randrange(len(live))) for _ in range(2)]
        ops = [*(Free(r) for r in victims), alloc(rid, rng), alloc(rid + 1, rng)]
        live += [rid, rid + 1]
        rid += 2
        msg += 1
        reg.step(sess, entry, encode_ops(ops), msg)
        store.commit(reg, set())
    pool = entry.pool
    return {"blocks": blocks, "requests": len(pool.requests), "used_blocks": pool.blocks.num_used,
            "cached_blocks": len(pool.blocks.cached), "free_blocks": pool.blocks.num_free,
            "snapshots": store.counts["snapshots"]}


def snapshot_pauses(store: RedisStore, reg: Registry, url: str) -> dict:
    """The loop's pause for one snapshot: written on the loop (old) or by a forked child (new)."""
    t0 = time.perf_counter()
    store.compact(reg)
    old = time.perf_counter() - t0
    store.compaction._reconnect = lambda: connect(url, timeout_s=60.0)
    pauses, child = [], 0.0
    for _ in range(3):  # the median of 3: a fork's cost varies with what else the machine runs
        before = store.counts["snapshots"]
        t0 = time.perf_counter()
        store.compaction.in_background(reg, store.seq)  # what the loop runs when the journal outgrows snapshot_bytes
        pauses.append(time.perf_counter() - t0)
        store.wait_for_snapshot()
        child = time.perf_counter() - t0
        if store.counts["snapshots"] != before + 1:
            raise SystemExit(f"the background snapshot failed: {store.stats()}")
    return {"snapshot_pause_old_s": old, "snapshot_pause_new_s": sorted(pauses)[1], "snapshot_child_s": child,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def old_recover(reg: Registry, snap: bytes, blobs: list[bytes]) -> None:
    """Recovery as it was: the garbage collector on, then the per-block invariant check."""
    gc.enable()
    seq = load_registry(decode_state(snap), reg, time.monotonic())
    replay(reg, blobs, seq, time.monotonic())
    reg.check_invariants()


class StallWatch:
    """A thread that sleeps 1 ms at a time and records the longest wait for its next turn."""

    def __init__(self) -> None:
        self.longest, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        prev = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            self.longest, prev = max(self.longest, now - prev - 0.001), now

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def whole_calls() -> Iterator[None]:
    """Each bulk step of the recovery in one C call (no pieces): the baseline of the stall."""
    piece, bulk.PIECE = bulk.PIECE, 1 << 40
    try:
        yield
    finally:
        bulk.PIECE = piece


def cold_start(url: str, ns: str, expect: dict) -> dict:
    """What a restarted manager does, timed step by step, the old way and the new."""
    client = connect(url, timeout_s=60.0)
    k = namespace_keys(ns)
    t0 = time.perf_counter()
    snap, blobs, seq = client.register_script("return {redis.call('GET', KEYS[1]), redis.call('LRANGE', "
                                              "KEYS[2], 0, -1), redis.call('GET', KEYS[3])}")(
        keys=[k["snap"], k["journal"], k["seq"]], args=[])
    t_read = time.perf_counter() - t0
    client.close()
    reg = new_registry()
    t1 = time.perf_counter()
    old_recover(reg, snap, blobs)
    t_old = time.perf_counter() - t1
    del reg
    gc.collect()
    reg = new_registry()
    with whole_calls(), StallWatch() as whole:  # the same recovery with each bulk step in one call
        recover(reg, snap, blobs, int(seq), "bench", time.monotonic())
    del reg
    gc.collect()
    reg = new_registry()
    t1 = time.perf_counter()
    with StallWatch() as watch:
        recover(reg, snap, blobs, int(seq), "bench", time.monotonic())  # decode, load, replay, check
    t_recover = time.perf_counter() - t1
    if dump_registry(reg, 0) != expect:
        raise SystemExit("the recovered state differs from the one built")
    return {"snapshot_bytes": len(snap), "journal_batches": len(blobs), "journal_bytes": sum(map(len, blobs)),
            "read_s": t_read, "recover_old_s": t_old, "recover_s": t_recover, "total_s": t_read + t_recover,
            "longest_stall_s": watch.longest, "longest_stall_whole_s": whole.longest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--tail-steps", type=int, default=2000)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ns = f"bench-recovery-{uuid.uuid4().hex[:8]}"
    client = connect(args.redis_url, timeout_s=60.0)
    store = RedisStore(client, ns, owner="bench", lease_ms=600_000, snapshot_bytes=32 << 20)
    try:
        reg = new_registry()
        store.acquire()
        store.load(reg, 0.0)
        t0 = time.perf_counter()
        built = build(store, reg, args.blocks, args.tail_steps, args.seed)
        built["build_s"] = time.perf_counter() - t0
        start = cold_start(args.redis_url, ns, dump_registry(reg, 0))  # before the pauses compact the tail away
        gc.collect()
        built.update(snapshot_pauses(store, reg, args.redis_url))
    finally:
        keys = list(client.scan_iter(f"kvpool:{{{ns}}}:*"))
        if keys:
            client.delete(*keys)
        client.close()
    out = {**built, **start}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"pool of {out['blocks']:,} blocks: {out['requests']:,} live requests holding {out['used_blocks']:,} "
          f"blocks, {out['cached_blocks']:,} cached hashes, {out['free_blocks']:,} free (built in {out['build_s']:.1f}s)")
    print(f"snapshot, the loop's pause: {out['snapshot_pause_new_s'] * 1e3:.1f} ms forking a writer (it wrote in "
          f"{out['snapshot_child_s']:.2f}s) vs {out['snapshot_pause_old_s'] * 1e3:.0f} ms writing on the loop: "
          f"{out['snapshot_pause_old_s'] / out['snapshot_pause_new_s']:.0f}x shorter (peak RSS {out['rss_mib']:,.0f} MiB)")
    print(f"cold start: snapshot {out['snapshot_bytes'] / 2**20:.1f} MiB + journal tail {out['journal_batches']:,} "
          f"batches ({out['journal_bytes'] / 2**20:.1f} MiB)")
    print(f"  read from Redis {out['read_s']:.2f}s + decode, load, replay, check {out['recover_s']:.2f}s "
          f"= restart time {out['total_s']:.2f}s")
    print(f"  recovery {out['recover_s']:.2f}s vs {out['recover_old_s']:.2f}s the old way (per-block check, GC on): "
          f"{out['recover_old_s'] / out['recover_s']:.1f}x faster")
    print(f"  a thread beside the recovery waited at most {out['longest_stall_s'] * 1e3:.0f} ms for its turn vs "
          f"{out['longest_stall_whole_s'] * 1e3:.0f} ms with each bulk step in one call (the lease renewal while "
          f"loading runs every lease_ms / 3: {LEASE_MS // 3} ms at the default lease)")


if __name__ == "__main__":
    main()
