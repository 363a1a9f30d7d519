"""Hostile input over a real socket: >= 10,000 malformed or malicious messages.

Every message with a parseable envelope gets an error (or ok) reply with a code and a message;
malformed envelopes are dropped and counted; no message causes an internal error; a victim
client keeps being served throughout and its requests are untouched; the invariants hold.
"""

from __future__ import annotations

import random

import msgpack
import zmq
from helpers.manager import SPEC, kv_bytes

from kvpool.client.manager import ManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.protocol import ERROR_CODES, pack, unpack

ADMIN_KEY = "fuzz-admin-key"
N_MESSAGES = 12_000
OPS = ["step"] * 8 + ["hello", "register", "lookup", "locate", "heartbeat", "stats", "pools", "sessions",
       "requests", "reset_cache", "evict", "drain", "shutdown", "check", "deregister", "nope", ""]
SUB_OP_CODES = {"no_space", "bad_field", "bad_hash", "bad_count", "bad_hashes", "duplicate_request",
                "unknown_request", "bad_sub_op", "unknown_sub_op", "draining"}


def junk(rng: random.Random, depth: int = 0):
    """A random msgpack-able value of any type, including the nasty ones."""
    kinds = ["int", "bigint", "neg", "float", "str", "bytes", "none", "bool", "ext"]
    if depth < 3:
        kinds += ["list", "map"]
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(0, 100)
    if k == "bigint":
        return rng.choice([2**31, 2**63 - 1, 2**64 - 1, 2**32 + 1])
    if k == "neg":
        return -rng.randint(1, 2**63)
    if k == "float":
        return rng.choice([0.5, -1.0, float("inf"), float("nan"), 1e300])
    if k == "str":
        return rng.choice(["", "p", "x" * 200, "\u00e9\u4e2d", "alloc", "free"])
    if k == "bytes":
        return rng.randbytes(rng.choice([0, 1, 31, 32, 33, 64]))
    if k == "none":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "ext":
        return msgpack.ExtType(rng.randint(0, 127), rng.randbytes(8))
    if k == "list":
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["op", "req", "pool", "hashes", "x", "args"]): junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def valid_sub_op(rng: random.Random) -> dict:
    req = rng.randint(0, 20)
    hs = hash_blocks([rng.randint(0, 5)] * 16, SPEC["block_size"])
    return rng.choice([
        {"op": "alloc", "req": req, "hashes": hs[: rng.randint(0, 3)], "prompt_len": 16, "max_new": 16},
        {"op": "extend", "req": req, "num_tokens": rng.randint(0, 40)},
        {"op": "free", "req": req},
        {"op": "fork", "req": req, "child": rng.randint(0, 20)},
    ])


def mutate(rng: random.Random, d: dict) -> dict:
    d = dict(d)
    for _ in range(rng.randint(1, 2)):
        key = rng.choice(list(d) + ["extra"])
        if rng.random() < 0.2:
            d.pop(key, None)
        else:
            d[key] = junk(rng)
    return d


def valid_args(rng: random.Random, op: str) -> dict:
    hs = hash_blocks(list(range(16)), SPEC["block_size"])
    if op == "step":
        return {"pool": "p", "epoch": 1, "ops": [valid_sub_op(rng) for _ in range(rng.randint(0, 6))]}
    if op == "register":
        return {"pool": f"fz-{rng.randint(0, 3)}", "shard_rank": 0, "shard_count": 1, "incarnation": "f",
                "spec": dict(SPEC), "available_kv_bytes": kv_bytes(rng.choice([1, 8, 10**6]))}
    if op in ("lookup", "locate"):
        return {"pool": "p", "hashes": hs}
    if op in ("requests", "reset_cache", "evict"):
        return {"pool": "p", "n": 2}
    if op == "hello":
        return {"identity": "fz", "role": rng.choice(["worker", "admin", "bogus"]), "versions": [1]}
    return {}


def hostile(rng: random.Random, sid: str) -> tuple[list[bytes], bool]:
    """One hostile message as frames; True when its envelope is malformed (to be dropped)."""
    r = rng.random()
    if r < 0.03:
        return [b"frame-one", pack({"v": 1, "id": 1, "op": "stats"})], True
    if r < 0.15:
        return [rng.randbytes(rng.randint(0, 300))], False
    if r < 0.25:
        return [pack(junk(rng))], False
    if r < 0.27:
        return [b"\x91" * 5000 + b"\xc0"], False  # nesting deeper than the unpacker allows
    if r < 0.28:
        return [b"\xc4\x00" * 40_000], False  # over max_message_bytes (64 KiB here)
    op = rng.choice(OPS)
    own = op != "deregister"  # the fuzzer keeps its session; deregister gets someone else's sid
    msg = {"v": 1, "id": rng.randint(0, 2**64 - 1), "op": op, "sid": sid if own else rng.randbytes(16).hex(),
           "args": valid_args(rng, op)}
    if op == "step" and rng.random() < 0.7:
        msg["args"]["ops"] = [mutate(rng, o) if rng.random() < 0.5 else o for o in msg["args"]["ops"]]
        msg["args"]["ops"].append(junk(rng))
    elif rng.random() < 0.6:
        msg["args"] = mutate(rng, msg["args"])
    if rng.random() < 0.15:
        msg = mutate(rng, msg)
    payload = pack(msg)
    if rng.random() < 0.05:
        payload = payload[: rng.randint(0, len(payload) - 1)]  # truncated
    return [payload], False


def check_reply(raw: bytes, inc: str) -> str:
    rep = unpack(raw)
    assert type(rep) is dict and rep["inc"] == inc
    status = rep["status"]
    if status == "ok":
        for res in rep["body"].get("results", []):
            assert res["ok"] or (res["code"] in SUB_OP_CODES and isinstance(res["msg"], str)), res
    else:
        assert status in ERROR_CODES and isinstance(rep["msg"], str) and rep["msg"], rep
    return status


def victim_round(victim: ManagerClient, epoch: int, i: int, hs: list[bytes]) -> None:
    res = victim.step("p", epoch, [{"op": "alloc", "req": 1000 + i, "hashes": hs, "prompt_len": 20, "max_new": 20},
                                   {"op": "free", "req": 1000 + i}])
    assert res[0]["ok"] and res[1] == {"ok": True}, res
    assert victim.lookup("p", hs) == len(hs)


def test_fuzz_10k_hostile_messages(live_server):
    live = live_server(max_message_bytes=64 * 1024, admin_key=ADMIN_KEY, max_sessions=300, max_pools=16,
                       session_timeout_s=600)
    srv = live.server
    admin = ManagerClient(live.endpoint, role="admin", admin_key=ADMIN_KEY, timeout_s=20)
    victim = ManagerClient(live.endpoint, identity="victim", timeout_s=20)
    epoch = victim.register("p", shard_rank=0, shard_count=1, incarnation="v", spec=SPEC,
                            available_kv_bytes=kv_bytes(256))["epoch"]
    hs = hash_blocks(list(range(20)), SPEC["block_size"])
    held = victim.step("p", epoch, [{"op": "alloc", "req": 1, "hashes": hs, "prompt_len": 20, "max_new": 20}])[0]
    fuzzer = ManagerClient(live.endpoint, identity="fuzzer")
    sid = fuzzer.hello()["sid"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(live.endpoint)
    rng = random.Random(1234)
    statuses: dict[str, int] = {}
    sent = dropped = 0
    try:
        while sent < N_MESSAGES:
            expect = 0
            for _ in range(200):
                frames, malformed = hostile(rng, sid)
                sock.send_multipart(frames)
                sent += 1
                dropped += malformed
                expect += not malformed
            for _ in range(expect):
                assert sock.poll(20_000), "the manager stopped answering the fuzzer"
                status = check_reply(sock.recv(), srv.incarnation)
                statuses[status] = statuses.get(status, 0) + 1
            victim_round(victim, epoch, sent, hs)  # everyone else keeps being served
    finally:
        sock.close()
        ctx.term()
    assert sent >= 10_000 and srv.stats.dropped == dropped and "internal" not in srv.stats.errors
    assert sum(statuses.values()) == sent - dropped
    assert {"bad_message", "too_large", "unknown_op", "bad_field", "forbidden"} <= set(statuses)
    admin.call("check")
    rows = {r["req"]: r for r in admin.call("requests", pool="p")["requests"] if r["identity"] == "victim"}
    assert list(rows) == [1] and rows[1]["blocks"] == len(held["blocks"])
    fuzzer.deregister()
    assert victim.step("p", epoch, [{"op": "free", "req": 1}]) == [{"ok": True}]
    pool = next(p for p in admin.call("pools")["pools"] if p["pool"] == "p")
    assert pool["free_blocks"] == pool["num_blocks"] - 1 and pool["requests"] == 0
    admin.call("check")
    for c in (admin, victim, fuzzer):
        c.close()
