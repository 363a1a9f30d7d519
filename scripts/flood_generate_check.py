#!/usr/bin/env python3
"""A good client's pings to a worker while it is flooded with generate requests.

Real processes: a manager, one CPU worker (the tiny preset), a flooding client (kvpool.client's
``GenerateClient`` in its own process) that sends ``--messages`` generate requests as fast as its
socket takes them and reads whatever comes back, and a good client pinging the worker every
``--every-ms`` over its own connection. ``--same-connection`` pings over the flood's own
connection instead (what the front door's link to a worker does: its liveness pings travel
behind its requests). The worker is pinged for ``--quiet-s`` without the flood first (the
same-run baseline), then from the flood's first message until every flood request has its last.

    .venv/bin/python scripts/flood_generate_check.py                  # 20,000 generate messages
    .venv/bin/python scripts/flood_generate_check.py --same-connection --max-tokens 32
    .venv/bin/python scripts/flood_generate_check.py --messages 5000 --json

Prints one table (without and with the flood: pings, round trip p50/p99/max, pings with no
answer within ``--answer-s``) and what the flood got. Exits 1 when a ping went unanswered during
the flood: a worker answers pings between steps however much generate work waits, or a front
door takes it for silent.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable

import msgpack
import numpy as np
import zmq

from kvpool.client.generate import GenerateClient, WorkerUnavailable
from kvpool.devcluster.cluster import ClusterConfig, DevCluster
from kvpool.shared.generate import ErrorMessage, TokenMessage, parse_reply


class Pinger:
    """Pings every ``every_s`` over ``client``; round trips by this process's clock."""

    def __init__(self, client: GenerateClient, every_s: float, answer_s: float) -> None:
        self.client, self.every_s, self.answer_s = client, every_s, answer_s
        self.sent: dict[str, float] = {}
        self.rtts: list[float] = []
        self.blocked = 0  # pings that could not be sent yet: the connection took no message
        self.next_at = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self.next_at:
            try:
                self.sent[self.client.send("ping")] = now
            except WorkerUnavailable:  # the connection's pipe is full (a flood on it): counted, tried again
                self.blocked += 1
                return
            self.next_at = now + self.every_s

    def feed(self, msg: dict) -> bool:
        """True when ``msg`` answered one of our pings."""
        at = self.sent.pop(str(msg.get("id")), None)
        if at is not None:
            self.rtts.append(time.monotonic() - at)
        return at is not None

    def settle(self, read: Callable[[int], None]) -> None:
        """Waits for the answers still out, at most ``answer_s`` after each was sent."""
        while self.sent and any(time.monotonic() - t <= self.answer_s for t in self.sent.values()):
            read(50)

    def summary(self) -> dict:
        late = sum(r > self.answer_s for r in self.rtts)
        arr = np.array(self.rtts) * 1000 if self.rtts else np.array([float("nan")])
        return {"pings": len(self.rtts) + len(self.sent), "p50_ms": float(np.percentile(arr, 50)),
                "p99_ms": float(np.percentile(arr, 99)), "max_ms": float(arr.max()),
                "unanswered": len(self.sent) + late, "blocked": self.blocked}


class Flood:
    """Sends generate requests as fast as the socket takes them, reading replies whenever it
    cannot send (unless ``reads`` is off), then reads until each request has its last message."""

    def __init__(self, client: GenerateClient, prompt_len: int, max_tokens: int, reads: bool,
                 pinger: Pinger | None = None) -> None:
        self.client, self.prompt_len, self.max_tokens, self.reads = client, prompt_len, max_tokens, reads
        self.pinger = pinger  # pings over the same connection, between sends
        self.sent = self.tokens = self.refused = self.finished = 0

    def read(self, wait_ms: int) -> None:
        while self.client.sock.poll(wait_ms, zmq.POLLIN):
            wait_ms = 0
            msg = msgpack.unpackb(self.client.sock.recv(), raw=False)
            if self.pinger is not None and self.pinger.feed(msg):
                continue
            reply = parse_reply(msg)
            if isinstance(reply, ErrorMessage):
                self.refused += 1
            elif isinstance(reply, TokenMessage):
                self.tokens += reply.token is not None
                self.finished += reply.finished

    def run(self, messages: int, timeout_s: float) -> dict:
        started = time.monotonic()
        deadline = started + timeout_s
        while self.sent < messages and time.monotonic() < deadline:
            if self.pinger is not None:
                self.pinger.tick()
            try:
                prompt = [1 + (self.sent + i) % 250 for i in range(self.prompt_len)]
                self.client.submit(prompt, max_tokens=self.max_tokens, ignore_eos=True, temperature=0.0)
                self.sent += 1
            except WorkerUnavailable:  # our pipe is full: read a while (or just wait), then send on
                self.read(10) if self.reads else time.sleep(0.01)
        sent_s = time.monotonic() - started
        while self.finished + self.refused < self.sent and time.monotonic() < deadline:
            if self.pinger is not None:
                self.pinger.tick()
            self.read(20)
        if self.pinger is not None:
            self.pinger.settle(self.read)
        return {"sent": self.sent, "sent_s": sent_s, "tokens": self.tokens, "refused": self.refused,
                "finished": self.finished, "took_s": time.monotonic() - started}


def flood_process(endpoint: str, args: argparse.Namespace, started: mp.Event, out: mp.Queue) -> None:
    client = GenerateClient(endpoint)
    try:
        client.check_reachable()
        started.set()
        out.put(Flood(client, args.prompt_len, args.max_tokens, not args.no_read).run(args.messages, args.timeout))
    finally:
        client.close()


def ping_alone(client: GenerateClient, args: argparse.Namespace, running: Callable[[], bool]) -> dict:
    pinger = Pinger(client, args.every_ms / 1000, args.answer_s)

    def read(wait_ms: int) -> None:
        while client.sock.poll(wait_ms, zmq.POLLIN):
            wait_ms = 0
            pinger.feed(msgpack.unpackb(client.sock.recv(), raw=False))

    while running():
        pinger.tick()
        read(int(max(0.0, pinger.next_at - time.monotonic()) * 1000))
    pinger.settle(read)
    return pinger.summary()


def flooded_separately(ep: str, good: GenerateClient, args: argparse.Namespace) -> tuple[dict, dict]:
    spawn = mp.get_context("spawn")
    started, out = spawn.Event(), spawn.Queue()
    proc = spawn.Process(target=flood_process, args=(ep, args, started, out))
    proc.start()
    try:
        while not started.wait(0.1):  # the flood process starts (imports, connects) unmeasured
            if not proc.is_alive():
                raise RuntimeError("the flood process exited before flooding")
        summary = ping_alone(good, args, proc.is_alive)
        return summary, out.get(timeout=10)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run(args: argparse.Namespace) -> dict:
    cluster = DevCluster(ClusterConfig(num_workers=1, kv_blocks=4096, max_model_len=512), prefix="kvpool-gflood-")
    try:
        cluster.start(timeout_s=300)
        ep = cluster.worker_eps[0]
        good = GenerateClient(ep)
        try:
            until = time.monotonic() + args.quiet_s
            quiet = ping_alone(good, args, lambda: time.monotonic() < until)
            if args.same_connection:
                pinger = Pinger(good, args.every_ms / 1000, args.answer_s)
                got = Flood(good, args.prompt_len, args.max_tokens, not args.no_read, pinger).run(
                    args.messages, args.timeout)
                flooded = pinger.summary()
            else:
                flooded, got = flooded_separately(ep, good, args)
        finally:
            good.close()
        cluster.check_alive()
    finally:
        cluster.stop()
    return {"quiet": quiet, "flood": flooded, "flood_client": got, "load": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-read", action="store_true", help="the flood reads nothing until it has sent everything")
    ap.add_argument("--same-connection", action="store_true", help="ping over the flood's own connection")
    ap.add_argument("--every-ms", type=float, default=100.0)
    ap.add_argument("--answer-s", type=float, default=10.0, help="a ping answered later counts as unanswered")
    ap.add_argument("--quiet-s", type=float, default=10.0, help="the baseline: pinging without the flood")
    ap.add_argument("--timeout", type=float, default=900.0, help="the flood's own bound")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster on the way out
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 1 if r["flood"]["unanswered"] else 0
    where = "over the flood's connection" if args.same_connection else "over its own connection"
    print(f"{args.messages:,} generate messages (prompts of {args.prompt_len} tokens, max_tokens {args.max_tokens}"
          f"{', read only after sending' if args.no_read else ''}); a ping every {args.every_ms:.0f} ms {where}; "
          f"unanswered = no answer within {args.answer_s:.0f} s")
    print(f"{'':<14}{'pings':>7}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'unanswered':>12}{'send waits':>12}")
    for name, s in (("without flood", r["quiet"]), ("with flood", r["flood"])):
        print(f"{name:<14}{s['pings']:>7}{s['p50_ms']:>10.1f}{s['p99_ms']:>10.1f}{s['max_ms']:>10.1f}"
              f"{s['unanswered']:>12}{s['blocked']:>12}")
    print("(send waits: times a due ping could not be sent yet because the connection took no message)")
    g = r["flood_client"]
    print(f"flood: {g['sent']:,} sent in {g['sent_s']:.1f} s, {g['finished']:,} finished, {g['refused']:,} refused, "
          f"{g['tokens']:,} tokens, every request ended after {g['took_s']:.1f} s")
    print("load average {:.1f} {:.1f} {:.1f}".format(*r["load"]))
    return 1 if r["flood"]["unanswered"] else 0


if __name__ == "__main__":
    sys.exit(main())
