#!/usr/bin/env python3
"""The floor under a step's round trip: a bare pyzmq DEALER/ROUTER ping-pong over ipc with a
256-running sparse step's sizes (1,418 bytes out, 456 back), no kvpool code on either side.

The server process sleeps in ``poll`` or spins on ``EVENTS``; the client blocks in ``poll``, or
first spins up to ``--client-spin-us`` on a non-blocking recv (what a spinning ManagerClient would
do); back to back, or sleeping ``--gap-us`` after each reply. p50 and p90 per combination, all in
one run (bounded: ``--n`` round trips each).

    python scripts/bench_zmq_floor.py [--n 2000] [--client-spin-us 200] [--gap-us 1000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import zmq

REQUEST, REPLY = b"y" * 1418, b"x" * 456


def serve(endpoint: str, spin: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)
    while True:
        if spin:
            while not sock.getsockopt(events) & pollin:
                pass
        elif not sock.poll(1000):
            continue
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            break
        sock.send_multipart([frames[0], REPLY])
    sock.close(linger=0)
    ctx.term()


def client(endpoint: str, n: int, gap_s: float, spin_s: float) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(REQUEST)
        got = False
        while spin_s and time.perf_counter() < t0 + spin_s:
            try:
                sock.recv(zmq.NOBLOCK)
                got = True
                break
            except zmq.Again:
                pass
        if not got:
            if not sock.poll(5000):
                raise SystemExit("no reply within 5 s")
            sock.recv()
        times.append(time.perf_counter() - t0)
        if gap_s:
            time.sleep(gap_s)
    sock.close(linger=0)
    ctx.term()
    return times[n // 20:]  # the first 5%: connection set-up and warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per combination")
    ap.add_argument("--client-spin-us", type=int, default=200)
    ap.add_argument("--gap-us", type=int, default=1000)
    args = ap.parse_args()
    print(f"bare pyzmq ipc ping-pong, {len(REQUEST)} B out, {len(REPLY)} B back; machine load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="kvpool-zmq-floor-") as tmp:
        endpoint = f"ipc://{tmp}/floor.sock"
        for spin in (False, True):
            server = mp.Process(target=serve, args=(endpoint, spin))
            server.start()
            try:
                for gap_us in (0, args.gap_us):
                    for spin_us in (0, args.client_spin_us):
                        ts = client(endpoint, args.n, gap_us / 1e6, spin_us / 1e6)
                        print(f"  server {'spins' if spin else 'polls':<5}  gap {gap_us:>5} us  client spin {spin_us:>4} us:"
                              f"  p50 {1e6 * statistics.median(ts):6.0f} us  p90 {1e6 * sorted(ts)[len(ts) * 9 // 10]:6.0f} us")
            finally:
                ctx = zmq.Context()
                stop = ctx.socket(zmq.DEALER)
                stop.connect(endpoint)
                stop.send(b"stop")
                server.join(5)
                if server.is_alive():
                    server.kill()
                stop.close(linger=0)
                ctx.term()


if __name__ == "__main__":
    main()
