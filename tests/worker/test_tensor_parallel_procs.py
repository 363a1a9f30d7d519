"""Tensor parallelism across real processes: a manager daemon and `kvpool worker --tp-size 2`
(the launcher and two ranks over gloo) serving the tiny model, compared token for token with the
single-shard worker; then rank 1 is SIGKILLed (slow)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers.tp import rank_kv_bytes
from helpers.worker import greedy, make_engine, make_prompt
from helpers.worker_procs import Cluster, ClusterConfig

from kvpool.client.generate import GenerateClient
from kvpool.client.manager import ManagerClient
from kvpool.shared.protocol import SessionExpired, StaleEpoch

pytestmark = pytest.mark.slow
NUM_BLOCKS, MAX_MODEL_LEN, BATCH = 14, 128, 32  # small: four 90-token requests must preempt
SESSION_TIMEOUT_S = 5.0
EXIT_TP_PEER_LOST = 4


def child_pids(parent: int) -> dict[int, int]:
    """tp rank -> pid of the rank processes started by the launcher ``parent``."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"--tp-rank" in argv:
            ranks[int(argv[argv.index(b"--tp-rank") + 1])] = int(entry)
    return ranks


class Replica:
    """A manager and one two-rank pool, in the test cluster's private directory."""

    def __init__(self) -> None:
        self.cluster = Cluster(ClusterConfig())
        self.endpoint = f"ipc://{self.cluster.dir}/tp.sock"
        self.launcher = None
        self.ranks: dict[int, int] = {}
        self._started = 0

    def start_manager(self) -> None:
        c = self.cluster
        c.spawn(["manager", "--manager", c.manager_ep, "--session-timeout", str(SESSION_TIMEOUT_S)], "manager")

    def start(self) -> None:
        c = self.cluster
        self._started += 1
        self.launcher = c.spawn(
            ["-v", "worker", "--manager", c.manager_ep, "--pool", "tp", "--endpoint", self.endpoint,
             "--tp-size", "2", "--tp-timeout", "30", "--threads", "1", "--device", "cpu", "--dtype", "float32",
             "--kv-cache-memory", str(rank_kv_bytes(NUM_BLOCKS, 2)), "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-batched-tokens", str(BATCH)], f"tp-{self._started}")
        c.workers = [self.launcher]
        c.wait_ready(self.launcher, self.endpoint, 90)
        self.ranks = child_pids(self.launcher.pid)
        assert sorted(self.ranks) == [0, 1]

    def log(self) -> str:
        return Cluster.log_tail(self.launcher, 100_000)

    def stop(self) -> None:
        self.cluster.stop()  # SIGTERM to the launcher (-> rank 0 -> rank 1), then the manager
        for pid in self.ranks.values():  # whatever survived a failed test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def replica():
    r = Replica()
    try:
        r.start_manager()
        r.start()
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def single():
    """The single-shard worker on the same model, pool size and batch budget."""
    return make_engine(max_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCH)


def pool_info(admin: ManagerClient) -> dict:
    """The pool's row of the admin `pools` op (the admin session may have expired meanwhile)."""
    try:
        (pool,) = admin.call("pools")["pools"]
    except SessionExpired:
        (pool,) = admin.call("pools")["pools"]
    return pool


def wait_reformed(admin: ManagerClient, old: set[str], timeout_s: float = SESSION_TIMEOUT_S + 30) -> dict:
    """The pool's row once it is ready with none of the ``old`` incarnations among its shards."""
    deadline = time.monotonic() + timeout_s
    while True:
        pool = pool_info(admin)
        if pool["state"] == "ready" and not old & {s["incarnation"] for s in pool["shards"]}:
            return pool
        assert time.monotonic() < deadline, f"the pool did not re-form with new shards: {pool}"
        time.sleep(0.1)


def generate(client: GenerateClient, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Submits every prompt at once (they batch, and compete for blocks); greedy tokens of each."""
    ids = [client.submit(p, max_tokens=max_tokens) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    done = set()
    while len(done) < len(ids):
        msg = client.recv(60)
        assert msg is not None, "the worker sent nothing for 60s"
        assert "error" not in msg, msg
        if msg.get("heartbeat"):  # the worker says it is alive while a request waits (recv is raw)
            continue
        if msg["token"] is not None:
            out[msg["id"]].append(msg["token"])
        if msg["finished"]:
            done.add(msg["id"])
    return [out[i] for i in ids]


def test_two_ranks_serve_what_one_shard_serves(replica, single):
    client = GenerateClient(replica.endpoint)
    admin = ManagerClient(replica.cluster.manager_ep, role="admin")
    try:
        p = make_prompt(50, 50)
        first = generate(client, [p], 10)
        assert generate(client, [p], 10) == first == [single.generate([p], greedy(10))[0][0]]
        assert client.call("stats")["stats"]["cached_tokens"] == 48  # a prefix hit of three blocks
        prompts = [make_prompt(30 + i, 20 + i) for i in range(4)]
        assert generate(client, prompts, 60) == [o[0] for o in single.generate(prompts, greedy(60))]
        stats = client.call("stats")["stats"]
        assert stats["preemptions"] > 0 and stats["tp_size"] == 2
        pool = pool_info(admin)
        assert (pool["state"], pool["num_blocks"], pool["registered"]) == ("ready", NUM_BLOCKS, 2)
        assert [s["num_kv_heads"] for s in pool["shards"]] == [1, 1]
        rank1 = f"rank 1 registered its shard of pool tp: {NUM_BLOCKS} blocks, {stats['kv_cache_bytes']} KV bytes"
        assert rank1 in replica.log()
        assert stats["kv_cache_bytes"] * 2 == single.runner.kv_bytes == rank_kv_bytes(NUM_BLOCKS, 1)
        print(f"\nKV bytes per rank for {NUM_BLOCKS} blocks of tiny (fp32): tp 1 {single.runner.kv_bytes}, "
              f"tp 2 {stats['kv_cache_bytes']} on each of 2 ranks")
        deadline = time.monotonic() + SESSION_TIMEOUT_S + 1
        while time.monotonic() < deadline:  # idle: both ranks must heartbeat to keep their sessions
            time.sleep(1)
            admin.heartbeat()
        pool = pool_info(admin)
        assert (pool["state"], pool["epoch"]) == ("ready", 1)
        assert all(s["session"] is not None for s in pool["shards"])
    finally:
        client.close()
        admin.close()


def test_sigkill_of_rank_1_stops_the_pool_and_no_stale_cache_is_served(replica, single):
    client = GenerateClient(replica.endpoint)
    admin = ManagerClient(replica.cluster.manager_ep, role="admin")
    try:
        p = make_prompt(40, 70)
        assert generate(client, [p], 5) == [single.generate([p], greedy(5))[0][0]]  # now cached
        before = pool_info(admin)
        epoch, old = before["epoch"], {s["incarnation"] for s in before["shards"]}
        os.kill(replica.ranks[1], signal.SIGKILL)
        assert replica.launcher.wait(60) == EXIT_TP_PEER_LOST  # rank 0 stopped with an error
        assert "tensor-parallel rank 0 of pool 'tp' stops" in replica.log()
        pool = pool_info(admin)
        assert (pool["state"], pool["epoch"], pool["requests"]) == ("pending", epoch + 1, 0)
        with pytest.raises(StaleEpoch):  # what rank 0 would have got for its next step
            admin.step("tp", epoch, [])
        replica.start()  # every rank anew: new incarnations, empty KV tensors
        pool = wait_reformed(admin, old)
        # epoch + 2 when both new ranks registered after the dead rank's session expired. The new
        # rank 0 may register first, while that session still lives: the pool forms with the dead
        # shard (+2), then re-forms when the new rank 1 replaces it (+3) or when the dead session
        # expires first (pending, +3) and the new rank 1 registers (+4). Rank 0 answers pings from
        # its first registration, so any of these may still be under way when start() returns.
        assert pool["epoch"] in (epoch + 2, epoch + 3, epoch + 4)
        assert generate(client, [p], 5) == [single.generate([p], greedy(5))[0][0]]
        assert client.call("stats")["stats"]["cached_tokens"] == 0  # nothing of the old cache
        replica.launcher.send_signal(signal.SIGTERM)  # a clean stop: rank 0 frees, deregisters, stops rank 1
        assert replica.launcher.wait(60) == 0
        pool = pool_info(admin)
        assert (pool["state"], pool["requests"]) == ("pending", 0)
    finally:
        client.close()
        admin.close()
