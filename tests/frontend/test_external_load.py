"""The front door's cost for attached vLLM servers (frontend/external_load.py, frontend/router.py):
speculative entries, the servers' own load from their /metrics without the lag of the door's
own requests, KV room, and the CPU tier's partial credit. Pure: no sockets."""

from __future__ import annotations

import asyncio

from kvpool.frontend.directory import External, Polled
from kvpool.frontend.external_load import FOREIGN_BLOCKS, ExternalLoad
from kvpool.frontend.router import CPU_TIER_CREDIT, Candidate, KVRouter
from kvpool.shared.hashing import hash_blocks

CHAIN = hash_blocks(list(range(12 * 32)), 32)  # a 12-block prompt


def server(name: str, polled: Polled | None = None) -> External:
    return External(0, name, "m", f"http://{name}", 32, None, polled=polled)


def test_a_routed_prompt_counts_for_its_server_while_it_runs_and_a_grace_after():
    load, s = ExternalLoad(), server("a")
    sent = load.start(s.key, prefill=12.75, decode=0.25, tail=1.25, chain=CHAIN)
    c = load.candidate(s, 0, 0, CHAIN, 12, 1.25)
    assert (c.routed_blocks, c.expected_blocks, c.running, c.outstanding) == (12, 12, 1, 13.0)
    assert load.candidate(server("b"), 0, 0, CHAIN, 12, 1.25).routed_blocks == 0
    load.finish(sent)  # no event loop here: the grace is skipped, the entry goes at once
    c = load.candidate(s, 0, 0, CHAIN, 12, 1.25)
    assert (c.routed_blocks, c.running, c.outstanding) == (0, 0, 0.0)
    load.finish(sent)  # twice is once
    assert load.running(s.key) == 0
    sent = load.start(s.key, 12.75, 0.25, 1.25, CHAIN)
    load.first_token(sent)  # its prompt is computed: only the decode is left
    load.first_token(sent)
    assert load.candidate(s, 0, 0, CHAIN, 12, 1.25).outstanding == 0.25
    load.finish(sent)
    assert load.candidate(s, 0, 0, CHAIN, 12, 1.25).outstanding == 0.0


def test_the_grace_keeps_the_entry_until_it_ends(monkeypatch):
    from kvpool.frontend import external_load

    monkeypatch.setattr(external_load, "ROUTED_GRACE_S", 0.05)
    load, s = ExternalLoad(), server("a")

    async def scenario() -> tuple[int, int]:
        load.finish(load.start(s.key, 12.75, 0.25, 1.25, CHAIN))
        during = load.candidate(s, 0, 0, CHAIN, 12, 1.25).routed_blocks
        await asyncio.sleep(0.1)
        return during, load.candidate(s, 0, 0, CHAIN, 12, 1.25).routed_blocks

    assert asyncio.run(scenario()) == (12, 0)


def test_other_clients_requests_count_and_the_doors_own_are_not_counted_twice():
    load, now = ExternalLoad(), 100.0
    a = load.start(("0", "a"), 1.75, 0.25, 1.0, [])  # (keys are any tuple)
    b = load.start(("0", "a"), 1.75, 0.25, 1.0, [])
    polled = Polled(at=load.servers[("0", "a")].history[-1][0], running=2, waiting=3, kv_usage=0.1, num_blocks=None)
    s = External("0", "a", "m", "http://a", 32, None, polled=polled)  # type: ignore[arg-type]
    now = polled.at + 0.5
    c = load.candidate(s, 0, 0, [], 12, 1.0, now=now)
    assert c.extra_load == FOREIGN_BLOCKS * 3  # 5 at the server, 2 of them this door's
    load.finish(a)
    load.finish(b)  # the poll still says 5: the door's two finished since, the other 3 remain
    assert load.candidate(s, 0, 0, [], 12, 1.0, now=now).extra_load == FOREIGN_BLOCKS * 3
    assert load.candidate(s, 0, 0, [], 12, 1.0, now=polled.at + 60).extra_load == 0  # too old a poll


def test_a_request_that_does_not_fit_the_free_kv_blocks_counts_the_load_twice():
    load = ExternalLoad()
    load.start(("0", "a"), 5.75, 0.25, 1.0, [])
    at = load.servers[("0", "a")].history[-1][0]
    full = External("0", "a", "m", "http://a", 32, None,  # type: ignore[arg-type]
                    polled=Polled(at, 1, 0, kv_usage=0.9, num_blocks=40))
    roomy = External("0", "a", "m", "http://a", 32, None,  # type: ignore[arg-type]
                     polled=Polled(at, 1, 0, kv_usage=0.1, num_blocks=40))
    assert load.candidate(full, 0, 0, [], 12, 1.0, now=at).load == 12.0  # 36 of 40 used: 13 do not fit
    assert load.candidate(roomy, 0, 0, [], 12, 1.0, now=at).load == 6.0


def test_cpu_tier_blocks_earn_a_partial_credit_and_a_stale_mirror_none():
    r = KVRouter("kv-aware", 2.0)
    a = Candidate(server("a"), hit_blocks=2, running=0, outstanding=0.0, host_blocks=8)
    b = Candidate(server("b"), hit_blocks=5, running=0, outstanding=0.0)
    assert a.expected_blocks == 2 + 8 * CPU_TIER_CREDIT == 6.0
    assert r.choose([b, a], 12).worker.name == "a"  # 6 expected against 5
    c = Candidate(server("c"), hit_blocks=2, running=0, outstanding=0.0, host_blocks=4)
    assert r.choose([c, b], 12).worker.name == "b"  # 4 against 5: a device hit is worth more
