#!/usr/bin/env python3
"""The host tier's copies on a GPU: a save/load round trip checked exactly, then their cost.

Llama-3-8B's KV shape (32 layers, 8 kv heads, head 128, bf16, block 16: 64 KiB a block and
layer). The check saves blocks right after main-stream work that writes them, overwrites them
on the main stream at once (the next forward pass), loads them back elsewhere and reads them on
the main stream at once: any missing wait shows as different K/V. The measure times a step of
``--blocks`` saves and as many loads followed by a stand-in forward pass (matmuls), the copies
on the side stream (``HostCopier``, worker/host_kv.py) against the same copies made synchronous
before the forward (what the worker did before), medians of interleaved runs.

    .venv/bin/python scripts/check_host_copy.py             # check, CUDA tests, measure (needs CUDA)
    .venv/bin/python scripts/check_host_copy.py --cpu-smoke # the check only, tiny, on CPU

On a GPU it also runs the CUDA tests of tests/worker/test_host_copy.py (skipped without a device
in the normal suite), so one command checks the side stream end to end: the engine's own forward
pass right after its loads.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the round-trip check only, tiny sizes, on CPU")
    p.add_argument("--blocks", type=int, default=64, help="saves and loads of the measured step")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-tests", action="store_true", help="skip the CUDA tests of tests/worker/test_host_copy.py")
    return p.parse_args()


def make_caches(device, dtype, layers, blocks, block_size=16, heads=8, head_size=128):
    import torch

    return [torch.randn(2, blocks, block_size, heads, head_size, dtype=dtype, device=device) for _ in range(layers)]


def round_trip(device, dtype, layers: int, n: int) -> bool:
    """Saves blocks 1..n, overwrites them, loads them into n+1..2n: True when every layer's K/V
    came back bit for bit."""
    import torch

    from kvpool.worker.host_kv import HostCopier

    dev = make_caches(device, dtype, layers, 2 * n + 1)
    copier = HostCopier(dev, n + 1)
    ids = list(range(1, n + 1))
    if device == "cuda":
        torch.cuda._sleep(20_000_000)  # the last forward pass is still running when the step starts
    for c in dev:
        c[:, ids] *= 2
    want = [c[:, ids].clone() for c in dev]
    copier.run([(b, b) for b in ids], [])
    for c in dev:
        c[:, ids] = 0  # the forward pass right after the saves
    copier.run([], [(b, b + n) for b in ids])
    got = [c[:, [b + n for b in ids]].clone() for c in dev]  # attention reads the loads at once
    copier.settle()
    return all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))


def measure(blocks: int, repeats: int) -> None:
    import os

    import torch

    from kvpool.worker.host_kv import HostCopier

    dev = make_caches("cuda", torch.bfloat16, 32, 4 * blocks + 1)
    copier = HostCopier(dev, 2 * blocks + 1)
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") / 64  # products stay finite
    saves = [(b, b) for b in range(1, blocks + 1)]
    loads = [(b + blocks, b + 2 * blocks) for b in range(1, blocks + 1)]

    def forward() -> None:
        y = x
        for _ in range(32):  # one matmul a layer: a stand-in the size of a decode step's weights
            y = y @ x
        torch.cuda.current_stream().synchronize()

    def step(side: bool) -> float:
        start = time.perf_counter()
        copier.run(saves, loads)
        if not side:
            copier.settle()  # synchronous: every transfer done before the forward starts
        forward()
        return time.perf_counter() - start

    for _ in range(3):
        step(True)
        step(False)
        forward()
    times: dict[str, list[float]] = {"side stream": [], "synchronous": [], "forward alone": []}
    for _ in range(repeats):  # interleaved: the machine's load hits both alike
        times["side stream"].append(step(True))
        times["synchronous"].append(step(False))
        start = time.perf_counter()
        forward()
        times["forward alone"].append(time.perf_counter() - start)
    copier.settle()
    mib = 2 * blocks * 32 * dev[0][:, 1].numel() * 2 / (1 << 20)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{torch.cuda.get_device_name()}: {blocks} saves + {blocks} loads ({mib:.0f} MiB) per step, "
          f"load avg {os.getloadavg()[0]:.2f}")
    for k, v in med.items():
        print(f"  {k:14s} {v:8.2f} ms")
    copies = med["synchronous"] - med["forward alone"]
    hidden = (med["synchronous"] - med["side stream"]) / copies if copies > 0 else 0.0
    print(f"  side stream / synchronous: {med['side stream'] / med['synchronous']:.2f}x; "
          f"{hidden:.0%} of the copy time hidden behind the forward")


def main() -> None:
    args = parse_args()
    import torch

    if args.cpu_smoke:
        ok = round_trip("cpu", torch.float32, 2, 3)
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --cpu-smoke)")
    else:
        ok = round_trip("cuda", torch.bfloat16, 32, args.blocks)
    print(f"round trip: {'PASS' if ok else 'FAIL'}")
    if not args.cpu_smoke and not args.no_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                "tests/worker/test_host_copy.py", "-k", "cuda"], cwd=ROOT)
        print(f"CUDA tests: {'PASS' if tests.returncode == 0 else 'FAIL'}")
        ok = ok and tests.returncode == 0
    if ok and not args.cpu_smoke:
        measure(args.blocks, args.repeats)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
