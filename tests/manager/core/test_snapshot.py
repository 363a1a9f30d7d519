"""Pool snapshots: an exact round trip, and corrupt state refused."""

import random

import msgpack
import pytest

from kvpool.manager.core import bulk
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.snapshot import CorruptState, dump_pool, load_pool
from kvpool.shared.hashing import hash_blocks

BS = 4


def churn(pool, rng, steps, start=0):
    """Random allocate/extend/fork/free; returns every result, so two pools can be compared."""
    out = []
    live = [k for k in pool.requests]
    for i in range(start, start + steps):
        r = rng.random()
        if r < 0.45 or not live:
            toks = [rng.randrange(3) for _ in range(rng.randint(1, 14))]
            key = ("s1", i)
            res = pool.allocate(key, hash_blocks(toks, BS), len(toks), rng.randint(1, 14))
            if res is not None:
                live.append(key)
            out.append(res)
        elif r < 0.65:
            key = rng.choice(live)
            out.append(pool.extend(key, pool.requests[key].num_tokens + rng.randint(0, 6)))
        elif r < 0.75:
            child = ("s2", i)
            out.append(pool.fork(rng.choice(live), child))
            live.append(child)
        else:
            key = live.pop(rng.randrange(len(live)))
            pool.free(key)
            out.append(None)
    return out


@pytest.mark.parametrize("piece", [1, 3, bulk.PIECE])  # decoding and checks run in pieces: cut across them
def test_round_trip_is_exact_and_behaves_identically(piece, monkeypatch):
    monkeypatch.setattr(bulk, "PIECE", piece)
    rng = random.Random(7)
    pool = Pool(24, BS)
    churn(pool, rng, 300)
    blob = msgpack.packb(dump_pool(pool), use_bin_type=True)
    copy = load_pool(msgpack.unpackb(blob, raw=False))
    assert dump_pool(copy) == dump_pool(pool)
    a = churn(pool, random.Random(99), 200, start=1000)
    b = churn(copy, random.Random(99), 200, start=1000)
    assert a == b, "a restored pool answers every later operation exactly as the original"
    assert dump_pool(copy) == dump_pool(pool)


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda d: d.update(format=99), "format"),
        (lambda d: d.update(ref_cnt=d["ref_cnt"][:-4]), "ref_cnt has"),
        (lambda d: d.update(hashes=d["hashes"][:-1]), "32-byte"),
        (lambda d: d.update(lru=b""), "invariant"),
        (lambda d: d["requests"].pop(), "invariant"),
        (lambda d: d.pop("stats"), "not loadable"),
    ],
)
def test_corrupt_state_is_refused(corrupt, match):
    pool = Pool(40, BS)
    churn(pool, random.Random(3), 120)
    for key in list(pool.requests)[::2]:
        pool.free(key)
    assert pool.requests and pool.blocks.free_queue.num_hashed(), "the scenario needs both"
    d = dump_pool(pool)
    corrupt(d)
    with pytest.raises(CorruptState, match=match):
        load_pool(d)


def test_a_corrupt_snapshot_is_refused_under_python_dash_O():
    # python -O strips assert statements: the checks that guard loaded state must not be asserts
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import random, sys
        sys.path.insert(0, HERE)
        from test_snapshot import churn, BS
        from kvpool.manager.core.pool import Pool
        from kvpool.manager.core.snapshot import CorruptState, dump_pool, load_pool
        assert False, "asserts must be off"
    """)
    check = textwrap.dedent("""
        pool = Pool(40, BS)
        churn(pool, random.Random(3), 120)
        for key in list(pool.requests)[::2]:
            pool.free(key)
        refused = 0
        for corrupt in (lambda d: d.update(lru=b""), lambda d: d["requests"].pop(),
                        lambda d: d.update(ref_cnt=d["ref_cnt"][:4] + (7).to_bytes(4, "little") + d["ref_cnt"][8:])):
            d = dump_pool(pool)
            corrupt(d)
            try:
                load_pool(d)
            except CorruptState:
                refused += 1
        from kvpool.manager.core.block_pool import InvariantBroken
        from kvpool.manager.registry import Registry
        reg = Registry("inc", session_timeout_s=10.0)
        sess = reg.open_session("w", "worker", False, 1, 0.0)
        from kvpool.shared.protocol import KVSpec
        entry = reg.register(sess, "p", 0, 1, "i", KVSpec(4, 1, 1, 2, "float16"), 1 << 20)
        entry.pool.allocate(("no-such-session", 1), [], 8, 8)  # what a corrupt journal could leave
        try:
            reg.check_invariants()
        except InvariantBroken:
            refused += 1
        print("refused", refused)
    """)
    code = code.replace("HERE", repr(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-O", "-c", code.replace('assert False, "asserts must be off"', check)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "4"]
