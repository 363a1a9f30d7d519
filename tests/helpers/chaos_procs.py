"""A chaos client (run as a script; not collected by pytest).

    chaos_procs.py ENDPOINTS POOL SEED STOP_FILE [CHECK_EVERY]    (ENDPOINTS comma-separated)

Steps a shared-prefix workload (allocs, extends, forks, frees) against a durable manager that
the test SIGKILLs at random. It keeps the block table of every request the manager acknowledged,
and every CHECK_EVERY steps compares it with the manager's own listing of this session's
requests: they must be identical (no acknowledged request lost, none invented, every block id
the same) unless the manager *told* it that its state is gone (ManagerRestarted: a new state
id, or a commit sequence below one it saw): then, as a worker does, it drops its requests,
registers again and carries on. Since the manager's own state never holds a block twice (the
test checks its invariants), a client whose view always equals the manager's, or that was told,
never believes it holds a block another client holds. At the STOP_FILE it frees everything,
checks that nothing is left and prints one JSON summary line (with its final block tables and
how often it was told); on a mismatch it prints the difference and exits 1.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tests/ holds `helpers`

from helpers.durable import random_step  # noqa: E402
from kvpool.client.manager import ManagerClient, ManagerRestarted, ManagerUnavailable  # noqa: E402
from kvpool.shared.protocol import KVSpec  # noqa: E402

SPEC = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
BLOCKS = 400
CHECK_EVERY = 4


def apply(tables: dict[int, list[int]], ops: list[dict], results: list[dict]) -> None:
    """The acknowledged effect of one step on the client's block tables."""
    for op, res in zip(ops, results):
        if not res["ok"]:
            continue
        kind = op["op"]
        if kind == "alloc":
            tables[op["req"]] = list(res["blocks"])
        elif kind == "extend":
            table = tables[op["req"]]
            for index, _src, dst in res["copies"]:
                table[index] = dst
            table.extend(res["blocks"])
        elif kind == "fork":
            tables[op["child"]] = list(res["blocks"])
        elif kind == "free":
            del tables[op["req"]]


def check(client: ManagerClient, pool: str, tables: dict[int, list[int]]) -> None:
    rows = client.call("requests", pool=pool, block_ids=True, limit=1 << 20)["requests"]
    mine = {r["req"]: r["block_ids"] for r in rows if r["session"] == client.session}
    if mine != tables:
        lost = sorted(set(tables) - set(mine))
        extra = sorted(set(mine) - set(tables))
        differ = sorted(k for k in set(mine) & set(tables) if mine[k] != tables[k])
        print(json.dumps({"event": "mismatch", "lost": lost, "extra": extra, "differ": differ}), flush=True)
        sys.exit(1)


def register(client: ManagerClient, pool: str) -> int:
    while True:  # the manager may be down right now: a first hello does not know it is durable
        try:
            return client.register(pool, shard_rank=0, shard_count=1, incarnation="chaos", spec=SPEC,
                                   available_kv_bytes=BLOCKS * KVSpec.from_wire(SPEC).block_bytes)["epoch"]
        except (ManagerUnavailable, ManagerRestarted):
            pass


def main(endpoints: list[str], pool: str, seed: int, stop_file: str, check_every: int) -> None:
    # several clients step on one pool: only admin sessions may share a pool (manager/guards.py)
    client = ManagerClient(endpoints, identity=f"chaos-{seed}", role="admin", timeout_s=0.5, failover_s=120.0)
    epoch = register(client, pool)
    rng = random.Random(seed)
    tables: dict[int, list[int]] = {}
    alive: list[int] = []
    next_rid = [0]
    steps = checks = told = 0
    incarnations = {client.incarnation}
    while not os.path.exists(stop_file):
        try:
            ops = random_step(rng, alive, next_rid)
            results = client.step(pool, epoch, ops)
            apply(tables, ops, results)
            alive[:] = list(tables)
            steps += 1
            incarnations.add(client.incarnation)
            if steps % check_every == 0:
                check(client, pool, tables)
                checks += 1
        except ManagerRestarted:  # told: what it was acknowledged is gone; a worker recomputes
            told += 1
            tables.clear()
            alive.clear()
            epoch = register(client, pool)
    while True:  # the last kill may be noticed here
        try:
            final = {r: list(t) for r, t in tables.items()}
            check(client, pool, tables)
            results = client.step(pool, epoch, [{"op": "free", "req": r} for r in tables])
            assert all(r["ok"] for r in results), results
            tables.clear()
            check(client, pool, tables)
            break
        except ManagerRestarted:
            told += 1
            tables.clear()
            epoch = register(client, pool)
    client.deregister()
    client.close()
    print(json.dumps({"event": "done", "steps": steps, "checks": checks + 2, "managers_seen": len(incarnations),
                      "state_id": client.state_id, "told": told, "tables": final}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), sys.argv[4],
         int(sys.argv[5]) if len(sys.argv) > 5 else CHECK_EVERY)
