"""The node tier with real processes: a manager with a node tier (host memory and disk) and CPU
workers of the tiny preset in two pools. A prefix one pool computed is loaded by the other with
the same greedy output; every fault on the way back (a flipped byte, a truncated file, a file
removed under the manager, a full disk, a worker SIGKILLed mid-save, the manager restarted with
the disk level still there) ends in recompute with the same greedy output, never in wrong K/V."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from helpers.node_procs import NodeCluster, generate, hashes, prompt_of, truth, worker_stats

from kvpool.client.generate import GenerateClient
from kvpool.shared.procs import CLI

pytestmark = pytest.mark.slow
N = 8  # tokens generated


@pytest.fixture
def nodes(tmp_path):
    c = NodeCluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def test_a_prefix_computed_by_one_pool_is_loaded_by_another_and_disk_faults_are_recomputed(nodes):
    a, b = nodes.worker("a"), nodes.worker("b")
    p1 = prompt_of(160, 1)  # 10 full blocks; the manager never loads the last (its logits are computed)
    want = truth(p1, N)
    assert generate(a, p1, N) == want
    nodes.settled()
    assert generate(b, p1, N) == want
    assert nodes.pool("b")["node_hit_tokens"] == 144
    sb = worker_stats(b)
    assert sb["cached_tokens"] == 144 and sb["computed_tokens"] < 40 and sb["node_loads"]["host"] == 9

    # blocks on disk only (write-through wrote them down; host memory forgets them), then a fault each
    prompts = {fault: prompt_of(96, seed) for seed, fault in enumerate(("flip", "truncate", "remove"), 10)}
    for p in prompts.values():
        assert generate(a, p, N) == truth(p, N)
    nodes.settled()
    assert nodes.admin.call("evict", pool="b", n=10_000, tier="node_host")["evicted"] >= 15
    files = nodes.disk_files([hashes(p)[2] for p in prompts.values()])
    assert len(files) == 3
    f = files[hashes(prompts["flip"])[2]]
    raw = bytearray(f.read_bytes())
    raw[64 + 1000] ^= 0x10
    f.write_bytes(bytes(raw))
    f = files[hashes(prompts["truncate"])[2]]
    os.truncate(f, f.stat().st_size // 2)
    files[hashes(prompts["remove"])[2]].unlink()
    for p in prompts.values():
        assert generate(b, p, N) == truth(p, N)
    nodes.settled()
    failures = worker_stats(b)["node_failures"]
    assert failures.get("mismatch") == 1 and failures.get("short_read") == 1 and failures.get("missing") == 1
    assert failures.get("prefetch_failed") == 3  # the host loads behind those prefetches: not run
    tier = nodes.tier()
    assert tier["disk"]["verify_failures"] == 3 and tier["disk"]["hits"] >= 15
    assert nodes.admin.call("check")  # every invariant, the node tier's included


def test_a_disk_read_that_never_returns_is_recomputed_after_the_workers_deadline(nodes):
    """A disk slot whose read blocks for ever (a FIFO nobody writes, as a hung mount blocks): the
    worker gives up at its --node-tier-read-timeout, recomputes, reports the order late, and
    serves on; before the deadline existed the step waited for ever (``generate`` times out)."""
    a = nodes.worker("a")
    b = nodes.worker("b", extra=("--node-tier-read-timeout", "0.5"))
    p = prompt_of(96, 50)
    assert generate(a, p, N) == truth(p, N)
    nodes.settled()
    assert nodes.admin.call("evict", pool="b", n=10_000, tier="node_host")["evicted"] >= 5
    (fifo,) = nodes.disk_files([hashes(p)[2]]).values()
    fifo.unlink()
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that writes nothing: the read blocks
    try:
        assert generate(b, p, N) == truth(p, N)
        nodes.settled()
        assert worker_stats(b)["node_failures"] == {"deadline": 1, "prefetch_failed": 1}
        disk = nodes.tier()["disk"]
        assert (disk["deadline_misses"], disk["verify_failures"]) == (1, 0)  # its hash left the disk level
        assert generate(b, p, N) == truth(p, N)  # the worker serves on
    finally:
        os.close(writer)  # the abandoned read returns (short) and its thread is free


def test_a_full_disk_drops_the_blocks_it_could_not_write(nodes):
    """A worker whose files cannot grow past 6,000 bytes (RLIMIT_FSIZE: EFBIG, as a full disk fails
    a write): its write-downs fail, the manager drops them, and the other pool recomputes."""
    a = nodes.worker("a", fsize_limit=6000)  # a block's file takes 8,256 bytes
    b = nodes.worker("b")
    p = prompt_of(96, 20)
    assert generate(a, p, N) == truth(p, N)
    tier = nodes.settled()
    assert tier["disk"]["save_failures"] == 6 and tier["disk"]["cached_blocks"] == 0
    assert nodes.admin.call("evict", pool="b", n=10_000, tier="node_host")["evicted"] == 6
    assert generate(b, p, N) == truth(p, N)
    assert nodes.pool("b")["node_hit_tokens"] == 0


def test_a_worker_killed_mid_save_and_a_restarted_manager_leave_nothing_loadable_as_whole(nodes):
    a, b = nodes.worker("a"), nodes.worker("b")
    long = prompt_of(480, 30)
    g = GenerateClient(a)
    g.submit(long, max_tokens=N, temperature=0.0)
    g.recv(60.0)  # the first message: its prefill ran, saves are being written
    nodes.cluster.kill("a")
    g.close()
    time.sleep(4.0)  # the session expires (3 s): its unreported batches are abandoned
    assert generate(b, long, N) == truth(long, N)
    assert nodes.settled()["batches"] == 0 and nodes.admin.call("check")

    # the manager restarts without a store: the disk files it wrote before are dropped, not trusted
    p = prompt_of(96, 31)
    assert generate(b, p, N) == truth(p, N)
    nodes.settled()
    before = list(nodes.disk.rglob("*.kv"))
    assert before
    nodes.restart_manager()
    c = nodes.worker("c")  # a new pool of the layout: nothing of the earlier index is served to it
    assert not [f for f in before if f.exists()]
    assert generate(c, p, N) == truth(p, N)
    assert nodes.pool("c")["node_hit_tokens"] == 0
    assert generate(b, p, N) == truth(p, N)  # b re-registered with the new manager and serves on


def test_operators_see_the_levels_and_pin_through_the_cli(nodes, tmp_path):
    a, b = nodes.worker("a"), nodes.worker("b")
    p = prompt_of(96, 40)
    assert generate(a, p, N) == truth(p, N)
    nodes.settled()
    assert generate(b, p, N) == truth(p, N)

    def cli(*args: str) -> str:
        out = subprocess.run([*CLI, *args, "-m", nodes.endpoint], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    stats = cli("stats")
    assert "node tiers:" in stats and "HITS device/host/node-host/node-disk" in stats
    b_row = next(line for line in stats.splitlines() if line.startswith("b "))
    assert "0.0%/0.0%/83.3%/0.0%" in b_row  # 80 of b's 96 prompt tokens from the node tier's host level
    assert "NODE_CACHED" in cli("pools")
    pools = json.loads(cli("pools", "--json"))
    assert {r["pool"]: r["node_host"][0] for r in pools} == {"a": 6, "b": 6}
    (tmp_path / "prompt.json").write_text(json.dumps(p))
    pin = json.loads(cli("pin", "--pool", "b", "--prompt-file", str(tmp_path / "prompt.json"), "--ttl", "1h", "--json"))
    assert pin["num_hashes"] == 6 and pin["device_blocks"] == 6 and 3590 < pin["remaining_s"] <= 3600
    assert [r["pin_id"] for r in json.loads(cli("pins", "--json"))["pins"]] == [pin["pin_id"]]
    assert nodes.tier()["host"]["retained_blocks"] == 6
    cli("unpin", str(pin["pin_id"]))
    assert json.loads(cli("pins", "--json"))["pins"] == [] and nodes.tier()["host"]["retained_blocks"] == 0
    metrics = nodes.admin.stats()  # the same counters Prometheus renders (manager/metrics.py)
    assert metrics["pools"]["b"]["node_host_hit_tokens"] == 80


def test_tensor_parallel_pools_share_the_tier_each_rank_through_its_own_store(nodes):
    """Two pools of `kvpool worker --tp-size 2` (a launcher and two ranks over gloo each): one
    tier for the layout, one store per rank; b loads on both ranks what a computed, and a slice
    flipped in rank 1's store is recomputed on both ranks."""
    tp = ("--tp-size", "2", "--tp-timeout", "60")
    a, b = nodes.worker("a", extra=tp), nodes.worker("b", extra=tp)
    assert len(list(nodes.shm.glob("kvpool-node-*.host"))) == 2  # rank 0's store and rank 1's
    p = prompt_of(160, 21)
    want = truth(p, N)
    assert generate(a, p, N) == want
    nodes.settled()
    assert generate(b, p, N) == want
    sb = worker_stats(b)
    assert sb["tp_size"] == 2 and sb["cached_tokens"] == 144 and sb["node_loads"]["host"] == 9
    assert nodes.pool("b")["node_hit_tokens"] == 144

    q = prompt_of(96, 22)
    assert generate(a, q, N) == truth(q, N)
    nodes.settled()
    (info,) = nodes.admin.stats()["manager"]["node_tiers"].values()
    key = hashes(q)[2]
    flipped = 0
    for f in nodes.shm.glob("kvpool-node-*.host"):  # rank 1's slice only (the tier's file is rank 0's)
        at = f.read_bytes().find(key)  # the key is at byte 32 of its slot's 64-byte header
        if at >= 0 and f.name != os.path.basename(info["host_file"]):
            with open(f, "r+b") as m:  # in place: the workers map the file
                m.seek(at - 32 + 64 + 100)
                byte = m.read(1)[0]
                m.seek(at - 32 + 64 + 100)
                m.write(bytes([byte ^ 0x10]))
            flipped += 1
    assert flipped == 1
    assert generate(b, q, N) == truth(q, N)
    nodes.settled()
    assert worker_stats(b)["node_recomputed_tokens"] == 48  # blocks 2-4 again, on both ranks
    assert nodes.tier()["host"]["verify_failures"] == 1
    assert nodes.admin.call("check")
