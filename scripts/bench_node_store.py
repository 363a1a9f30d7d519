#!/usr/bin/env python3
"""What verifying a node-store block costs against copying it, in one run: crc32 vs xxh3 vs memcpy.

For one block of a preset's shard (default: the tiny preset, fp32, block 16: 8 KiB), the median
over --repeats rounds of --iters calls each of:

  memcpy            numpy ``copyto`` of the block into another buffer (the least a load costs)
  torch copy_       the same copy through torch (its thread pool: slow on a loaded machine)
  zlib.crc32        the checksum the standard library offers
  xxh3_64           xxhash's 64-bit XXH3 (what worker/node_layout.py uses)
  xxh3_128          its 128-bit variant
  host write/read   HostStore.write and read_into (header, copy, checksum) on a /dev/shm segment
  disk write/read   DiskStore.write (no fsync: the page cache) and read_into

each printed in microseconds and as a ratio against memcpy measured in the same run.

    python scripts/bench_node_store.py
    python scripts/bench_node_store.py --preset small --dtype bfloat16
    python scripts/bench_node_store.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import zlib

import numpy as np
import torch
import xxhash

from kvpool.shared.protocol import KVSpec
from kvpool.worker.config import PRESETS
from kvpool.worker.node_store import DiskStore, HostStore, StoreLayout


def timed(fn, iters: int, repeats: int) -> float:
    """Median seconds per call."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    m = PRESETS[args.preset]
    spec = KVSpec(args.block_size, m.num_layers, m.num_kv_heads, m.head_size, args.dtype)
    lay = StoreLayout(spec, f"bench-{args.preset}")
    src = torch.randn(lay.block_shape).to(lay.dtype)
    dst = torch.empty_like(src)
    src_np, dst_np = src.view(torch.uint8).numpy(), dst.view(torch.uint8).numpy()
    raw = memoryview(src_np.reshape(-1))
    key = b"\x07" * 32
    it, rep = args.iters, args.repeats
    res = {
        "memcpy": timed(lambda: np.copyto(dst_np, src_np), it, rep),
        "torch copy_": timed(lambda: dst.copy_(src), it, rep),
        "zlib.crc32": timed(lambda: zlib.crc32(raw), it, rep),
        "xxh3_64": timed(lambda: xxhash.xxh3_64_intdigest(raw), it, rep),
        "xxh3_128": timed(lambda: xxhash.xxh3_128_intdigest(raw), it, rep),
    }
    with tempfile.TemporaryDirectory(dir=args.shm_dir) as shm, tempfile.TemporaryDirectory() as d:
        host = HostStore(lay, 4, shm)
        disk = DiskStore(lay, d, 8 * (lay.block_bytes + 64), fsync=False)
        res["host write"] = timed(lambda: host.write(1, key, src), it, rep)
        res["host read"] = timed(lambda: host.read_into(1, key, dst), it, rep)
        res["disk write"] = timed(lambda: disk.write(1, key, src), max(1, it // 10), rep)
        res["disk read"] = timed(lambda: disk.read_into(1, key, dst), max(1, it // 10), rep)
        if host.read_into(1, key, dst) is not None or not torch.equal(dst, src):
            raise SystemExit("the host store did not read back the block it wrote")
        host.close()
    base = res["memcpy"]
    if args.json:
        print(json.dumps({"block_bytes": lay.block_bytes, "preset": args.preset, "dtype": args.dtype,
                          "seconds": res, "vs_memcpy": {k: v / base for k, v in res.items()}}, indent=2))
        return
    print(f"one block: preset {args.preset}, {args.dtype}, block {args.block_size}: {lay.block_bytes} bytes "
          f"({lay.block_bytes / 1024:.0f} KiB); median of {rep} x {it} calls")
    print(f"{'':16} {'us/block':>10} {'GB/s':>8} {'x memcpy':>9}")
    for name, s in res.items():
        print(f"{name:16} {s * 1e6:10.2f} {lay.block_bytes / s / 1e9:8.2f} {s / base:9.2f}")


if __name__ == "__main__":
    main()
