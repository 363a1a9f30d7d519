"""Chaos with real processes and the real Redis: SIGKILL the manager at random under load.

After every restart the invariants hold and the manager's requests match what each client was
told (chaos_procs.py checks its own block tables against the manager's listing), and a worker's
greedy generation through the remote manager equals the reference although the manager is
killed mid-generation.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from helpers.durable import Daemon, chaos_clients, finish_chaos_clients
from helpers.manager import wait_until

from kvpool.client.manager import ManagerClient

pytestmark = [pytest.mark.slow, pytest.mark.redis]
KILLS = 22
CLIENTS = 3


def test_sigkill_the_manager_at_random_under_load(procs, sock_dir, namespace):
    daemon = Daemon(procs, sock_dir, namespace, snapshot_bytes=64 << 10)  # compactions happen under fire
    daemon.start()
    daemon.wait_active()
    stop = Path(sock_dir) / "stop"
    clients = chaos_clients(procs, daemon.endpoint, stop, CLIENTS)
    admin = ManagerClient(daemon.endpoint, role="admin", identity="chaos-admin", timeout_s=0.5, failover_s=60)
    rng = random.Random(1)
    downtime = []
    try:
        admin.hello()
        wait_until(lambda: admin.stats()["pools"].get("chaos", {}).get("allocations", 0) > 10, 30, "the clients")
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.05, 0.5))
            for c in clients:
                assert c.poll() is None, f"a chaos client failed: {c.stdout.read()}"
            daemon.kill()
            t0 = time.monotonic()
            daemon.start()
            body = admin.call("check")  # resent until the restarted manager answers: invariants hold
            downtime.append(time.monotonic() - t0)
            assert body["pools"] == 1
        stats = admin.stats()
        assert stats["store"]["snapshots"] >= 1 or stats["store"]["snapshot_seq"] > 0
        outs = finish_chaos_clients(clients, stop)
        assert all(o["event"] == "done" and o["steps"] > 20 and o["managers_seen"] > KILLS // 2 for o in outs), outs
        assert len({o["state_id"] for o in outs}) == 1  # every client kept its state across the kills
        assert all(o["told"] == 0 for o in outs), outs  # sync: no acknowledged step was ever lost
        pool = admin.stats()["pools"]["chaos"]
        assert pool["requests"] == 0 and pool["used_blocks"] == 0 and pool["free_blocks"] == pool["num_blocks"] - 1
        admin.call("check")
    finally:
        stop.touch()
        admin.close()
    print(f"{KILLS} kills; restart to first answer: max {max(downtime):.2f}s, "
          f"mean {sum(downtime) / len(downtime):.2f}s; steps {[o['steps'] for o in outs]}")


def test_a_worker_generation_survives_manager_kills(procs, sock_dir, namespace):
    from kvpool.worker.block_manager import RemoteBlockManager
    from kvpool.worker.config import PRESETS, WorkerConfig
    from kvpool.worker.reference import reference_generate
    from kvpool.worker.sampler import SamplingParams
    from kvpool.worker.startup import build_engine

    daemon = Daemon(procs, sock_dir, namespace)
    daemon.start()
    daemon.wait_active()
    tiny = PRESETS["tiny"]
    block_bytes = 2 * 16 * tiny.num_kv_heads * tiny.head_size * 4 * tiny.num_layers
    bm = RemoteBlockManager(daemon.endpoint, "gen", timeout_s=0.5)
    bm.client.failover_s = 60.0
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=96 * block_bytes,
                       max_model_len=256)
    engine = build_engine(cfg, bm)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, tiny.vocab_size) for _ in range(n)] for n in (20, 37, 9)]
    stop = threading.Event()
    kills = []

    def killer() -> None:
        while not stop.wait(rng.uniform(0.05, 0.2)) and len(kills) < 4:
            daemon.kill()
            daemon.start()
            kills.append(daemon.wait_active())

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {rid: [[]] for rid in ids}
    steps = 0
    try:
        while engine.has_work():
            # The kills land wherever the engine is; near the end it waits for the last ones,
            # so a fast machine cannot finish the generation before the manager died 4 times.
            deadline = time.monotonic() + 60
            while steps >= 60 and len(kills) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            for ev in engine.step():
                if ev.token is not None:
                    outs[ev.request_id][ev.index].append(ev.token)
            steps += 1
    finally:
        stop.set()
        thread.join(60)
    outs = [outs[rid] for rid in ids]
    assert len(kills) >= 4, f"the manager was killed {len(kills)} times, not 4"
    want = [[reference_generate(engine.model, p, 80, None)] for p in prompts]
    assert outs == want
    assert engine.stats()["resets"] == 0  # the worker carried on: nothing was recomputed
    engine.shutdown()
    bm.close()
