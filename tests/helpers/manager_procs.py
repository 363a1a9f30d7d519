"""Client processes for the integration tests (run as scripts; not collected by pytest).

    stepper ENDPOINT POOL RANK COUNT INC BLOCKS STEPS   register a shard, then step with shared prefixes
    holder  ENDPOINT POOL                               hold blocks, heartbeat until killed
    flooder ENDPOINT N                                  send N garbage messages unread, stay until they were read

Each prints one JSON line per milestone on stdout.
"""

from __future__ import annotations

import json
import random
import sys
import time

import zmq

from kvpool.client.manager import ManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.protocol import KVSpec, pack, unpack

SPEC = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
SHARED = list(range(1000, 1032))  # 32 tokens = 8 full blocks, the same in every process


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def stepper(endpoint: str, pool: str, rank: int, count: int, inc: str, blocks: int, steps: int) -> None:
    c = ManagerClient(endpoint, identity=f"stepper-{pool}-{rank}", timeout_s=30)
    reg = c.register(pool, shard_rank=rank, shard_count=count, incarnation=inc, spec=SPEC,
                     available_kv_bytes=blocks * KVSpec.from_wire(SPEC).block_bytes)
    say(event="registered", **reg)
    rng = random.Random(rank * 7919 + sum(map(ord, pool)))
    epoch, alive, rid = reg["epoch"], [], 0
    first_shared_cached = None
    cached = prompt_tokens = 0
    for _ in range(steps):
        ops = [{"op": "free", "req": r} for r in alive]
        new = []
        for _ in range(4):
            toks = SHARED + [rng.randrange(32000) for _ in range(rng.randint(1, 12))]
            new.append({"op": "alloc", "req": rid, "hashes": hash_blocks(toks, 4), "prompt_len": len(toks),
                        "max_new": len(toks)})
            rid += 1
        results = c.step(pool, epoch, ops + new)
        alive = []
        for op, res in zip(new, results[len(ops):]):
            assert res["ok"], res
            if first_shared_cached is None:
                first_shared_cached = res["cached"]
            alive.append(op["req"])
            cached += res["cached"]
            prompt_tokens += op["prompt_len"]
    c.step(pool, epoch, [{"op": "free", "req": r} for r in alive])
    say(event="done", first_shared_cached=first_shared_cached, cached=cached, prompt_tokens=prompt_tokens)
    # A shard that leaves takes its KV slice with it (the pool drops to pending at a new
    # epoch), so a shard stays registered until the test says every stepper is done.
    sys.stdin.readline()
    c.deregister()
    c.close()


def holder(endpoint: str, pool: str) -> None:
    c = ManagerClient(endpoint, identity="holder", timeout_s=30)
    epoch = c.register(pool, shard_rank=0, shard_count=1, incarnation="h", spec=SPEC,
                       available_kv_bytes=64 * KVSpec.from_wire(SPEC).block_bytes)["epoch"]
    res = c.step(pool, epoch, [{"op": "alloc", "req": i, "hashes": [], "prompt_len": 10, "max_new": 10}
                               for i in range(3)])
    say(event="holding", blocks=sum(len(r["blocks"]) for r in res), requests=len(res))
    while True:
        c.heartbeat()
        time.sleep(0.2)


def flooder(endpoint: str, n: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    bad = [b"\xc1", pack({"v": 1, "id": 1, "op": "step", "args": {"ops": [1] * 50}}), pack([1, 2, 3])]
    for i in range(n):
        sock.send(bad[i % len(bad)])
    say(event="sent", n=n)
    # ZeroMQ drops what a peer has not read yet when the sender disconnects: stay until the
    # manager has read the whole flood, shown by its answer to a marker sent after it (resent:
    # the manager drops replies this socket has not read while its queue is full)
    deadline, k = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        k += 1
        sock.send(pack({"v": 1, "id": (1 << 63) + k, "op": "heartbeat", "args": {}}))
        answered, until = False, time.monotonic() + 0.5
        while not answered and sock.poll(max(1, int(1000 * (until - time.monotonic())))):
            reply = unpack(sock.recv())
            answered = type(reply) is dict and type(reply.get("id")) is int and reply["id"] > 1 << 63
        if answered:
            break
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "stepper":
        stepper(args[0], args[1], int(args[2]), int(args[3]), args[4], int(args[5]), int(args[6]))
    elif mode == "holder":
        holder(args[0], args[1])
    elif mode == "flooder":
        flooder(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")
