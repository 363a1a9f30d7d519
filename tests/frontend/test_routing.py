"""KV-aware routing through the front door: the pool with the cached prefix wins; tenants'
salts keep them apart; two managers (two nodes) behind one front door; a worker killed
mid-stream ends the stream with a clean error event; no worker gives 503."""

from __future__ import annotations

import json
import random
import signal
import time

import httpx
import openai
import pytest
from helpers.frontend import SESSION_TIMEOUT_S, Stack

from kvpool.frontend.router import Candidate, KVRouter

pytestmark = pytest.mark.slow


def post(stack: Stack, body: dict) -> httpx.Response:
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_requests_sharing_a_prefix_go_to_the_pool_that_caches_it_across_two_managers() -> None:
    stack = Stack(workers=2, managers=2)  # w0 under manager 0, w1 under manager 1 (two nodes)
    try:
        rng = random.Random(3)
        system = [rng.randrange(3, 500) for _ in range(150)]
        names = {w.name for w in stack.fd.frontdoor.directory.workers.values()}
        assert names == {"w0", "w1@1"}
        home = post(stack, {"prompt": system + [7, 8]}).headers["x-kvpool-worker"]
        router = stack.fd.frontdoor.router
        before = router.decisions["prefix"]
        for i in range(6):
            r = post(stack, {"prompt": system + [rng.randrange(3, 500) for _ in range(5 + i)]})
            assert r.headers["x-kvpool-worker"] == home
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 144  # 9 full blocks
        assert router.decisions["prefix"] - before == 6
        salted = post(stack, {"prompt": system + [9], "cache_salt": "tenant-b"})
        assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another tenant: no hit
        salted_home = salted.headers["x-kvpool-worker"]
        again = post(stack, {"prompt": system + [10], "cache_salt": "tenant-b"})
        assert again.headers["x-kvpool-worker"] == salted_home
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 144
    finally:
        stack.close()


def test_workers_lost_mid_stream_end_streams_cleanly_and_new_workers_are_noticed() -> None:
    stack = Stack(workers=2)
    try:
        # raw HTTP: the worker serving the stream is killed -> an error event, then [DONE]
        with httpx.stream("POST", stack.url + "/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True},
                timeout=60) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(2)]
            stack.cluster.kill(r.headers["x-kvpool-worker"])
            rest = list(lines)
        events = [ln[6:] for ln in first + rest if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["reason"] == "worker_lost" and "gone" in err["message"]
        # the openai client: the other worker killed mid-stream -> an APIError
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=400, stream=True,
            extra_body={"ignore_eos": True})
        victim = stream.headers["x-kvpool-worker"]
        with pytest.raises(openai.APIError, match="gone"):
            for k, _ in enumerate(stream.parse()):
                if k == 2:
                    stack.cluster.kill(victim)
        # nobody left: 503, and /health says so
        with pytest.raises(openai.APIStatusError) as ei:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert ei.value.status_code == 503 and ei.value.body["reason"] == "no_worker"
        assert httpx.get(stack.url + "/health").status_code == 503
        # a worker that registers later is noticed without restarting the front door
        stack.cluster.worker(stack.managers[0], "late")
        stack.fd.wait_for_workers("tiny", 1)
        assert post(stack, {"prompt": "x"}).headers["x-kvpool-worker"] == "late"
        # the twin of a crash: a worker stopped cleanly (SIGTERM) aborts its requests and deregisters
        with httpx.stream("POST", stack.url + "/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True},
                timeout=60) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(2)]
            stack.cluster.named["late"].send_signal(signal.SIGTERM)
            rest = list(lines)
        events = [ln[6:] for ln in first + rest if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["reason"] in ("worker_ended", "worker_lost")
        assert stack.cluster.named["late"].wait(15) == 0
        deadline = time.monotonic() + 10 + SESSION_TIMEOUT_S  # (the killed ones' sessions expire meanwhile)
        while stack.fd.frontdoor.directory.workers:  # deregistered: gone from the manager's list
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while stack.fd.frontdoor.live or stack.fd.frontdoor.routed:  # the streams cut by errors are forgotten
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stack.close()


def fake_worker(name: str, num_blocks: int = 100, free: int = 100):
    from kvpool.frontend.directory import Worker

    class Link:
        running = 0
        lost = None

    return Worker(0, name, "tiny", f"ipc://{name}", 512, 16, num_blocks, free, 1, Link())


def test_the_cost_function_weighs_hits_against_load() -> None:
    a, b = fake_worker("a"), fake_worker("b")
    kv = KVRouter("kv-aware", overlap_weight=1.0)
    # 10 prompt blocks; a holds 8 of them but has 20 blocks of work outstanding: b (cost 10) beats a (2 + 20)
    assert kv.choose([Candidate(a, 8, 3, 20), Candidate(b, 0, 0, 0)], 10).worker is b
    # with a higher weight on the overlap, the prefix wins: 3*2 + 20 = 26 < 3*10 = 30
    assert KVRouter("kv-aware", overlap_weight=3.0).choose([Candidate(a, 8, 3, 20), Candidate(b, 0, 0, 0)],
                                                         10).worker is a
    # equal load: the hit decides, and is reported as a prefix decision
    d = kv.choose([Candidate(a, 0, 1, 4), Candidate(b, 5, 1, 4)], 10)
    assert d.worker is b and d.reason == "prefix" and d.hit_blocks == 5
    rr = KVRouter("round-robin")
    assert [rr.choose([Candidate(a, 9, 0, 0), Candidate(b, 0, 0, 0)], 10).worker.name for _ in range(4)] == \
        ["a", "b", "a", "b"]
    ll = KVRouter("least-loaded")
    assert ll.choose([Candidate(a, 9, 2, 0), Candidate(b, 0, 1, 0)], 10).worker is b
    with pytest.raises(ValueError, match="choose one of"):
        KVRouter("random")


def test_a_candidate_shares_blocks_with_prompts_routed_to_it_and_the_cached_count_stays_located() -> None:
    a, b = fake_worker("a"), fake_worker("b")
    kv = KVRouter("kv-aware", overlap_weight=2.0)
    # nothing cached anywhere yet, but a runs a prompt sharing 9 of the 10 blocks: a (2*1 + 10) beats b (2*10)
    d = kv.choose([Candidate(a, 0, 1, 10, routed_blocks=9), Candidate(b, 0, 0, 0)], 10)
    assert d.worker is a and d.reason == "prefix" and d.expected_blocks == 9
    assert d.hit_blocks == 0  # the response's cached_tokens: only what the manager located
    d = kv.choose([Candidate(a, 6, 1, 4, routed_blocks=3), Candidate(b, 0, 1, 4)], 10)
    assert (d.worker, d.hit_blocks, d.expected_blocks) == (a, 6, 6)  # the more of located and routed


def burst_front_door(count_routed: bool, workers: list, monkeypatch):
    """A front door over fake workers whose managers have nothing cached yet (every locate finds
    nothing: the burst arrives before its first prompt is computed)."""
    from kvpool.frontend.directory import Located
    from kvpool.frontend.service import FrontDoor, FrontDoorConfig

    fd = FrontDoor(FrontDoorConfig(("ipc:///tmp/kvpool-test-unused.sock",), count_routed=count_routed))

    class Tok:
        vocab_size = 1000

        def decode(self, ids, skip_special_tokens=True):
            return ""

    async def locate_all(manager, hashes):
        return Located()

    monkeypatch.setattr(fd, "workers", lambda model: workers)
    monkeypatch.setattr(fd, "tokenizer", lambda model: Tok())
    monkeypatch.setattr(fd.directory, "locate_all", locate_all)
    return fd


@pytest.mark.parametrize("count_routed", [True, False])
def test_a_burst_of_one_tenant_goes_to_one_worker_when_routed_prompts_count(count_routed, monkeypatch) -> None:
    import asyncio

    from kvpool.frontend.params import GenRequest

    workers = [fake_worker("a"), fake_worker("b"), fake_worker("c")]
    fd = burst_front_door(count_routed, workers, monkeypatch)
    system = list(range(1, 161))  # 10 blocks of 16

    def request(i: int, salt: str) -> GenRequest:
        return GenRequest(chat=False, model="tiny", prompts=[system + [500 + i, 600 + i]], messages=None,
                          max_tokens=4, cache_salt=salt)

    async def burst() -> list:
        return [await fd.start_run(request(i, "t1")) for i in range(6)]

    runs = asyncio.run(burst())
    homes = {r.runs[0].decision.worker.name for r in runs}
    if count_routed:
        assert len(homes) == 1  # the prompts routed before count as the home's future hits
        assert [r.runs[0].decision.reason for r in runs[1:]] == ["prefix"] * 5
        assert all(r.cached_tokens == 0 for r in runs)  # nothing was cached when they were routed
        other = asyncio.run(fd.start_run(request(9, "t2")))  # another tenant's salt shares nothing
        assert other.runs[0].decision.worker.name not in homes
        fd.release(other)
    else:
        assert len(homes) == 3  # locate alone: the burst spreads by load
    for r in runs:
        fd.release(r)
    assert fd.routed == {} and fd.live == {}
