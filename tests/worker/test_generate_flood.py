"""A worker behind a flood of generate requests still answers its pings, and the front door's
link to it loses nothing: a real manager and worker process, real DEALER sockets.

Behind a flood a ping waits for what its connection sent before it: the worker reads up to
READ_BATCH messages between two steps (it read 256, so a ping behind 20,000 generate messages
waited 78 steps, 22 s at load 18). The promise checked: a ping is answered within the front
door's worker-silence bound, and (the worker's own clock, whatever the load) within a few steps.
The link queues what the socket does not take (pyzmq's asyncio send dropped it silently)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager

import msgpack
import pytest
import zmq
import zmq.asyncio
from helpers.worker import make_prompt

from kvpool.client.generate import GenerateClient
from kvpool.client.generate_async import WorkerLink
from kvpool.client.generate_core import WorkerLost
from kvpool.devcluster.cluster import DevCluster
from kvpool.frontend.serve_config import ServeConfig
from kvpool.shared.generate import ErrorMessage, Pong, StatsReply, TokenMessage, parse_reply

pytestmark = pytest.mark.slow
FLOOD = 20_000
SILENCE_S = ServeConfig.worker_silence  # the front door takes a worker this long silent for stuck
END_S = 600.0  # every flood request ends (tokens or a refusal) within this, at a load of 16


@pytest.fixture(scope="module")
def cluster():
    c = DevCluster(prefix="kvpool-gflood-")
    try:
        manager = c.manager("manager", "--session-timeout", "120")  # outlives the worker's pauses here
        ep = c.worker(manager, "p0", kv_blocks=4096)
        c.wait_ready(c.workers[0], ep, 300)
        yield c, ep
    finally:
        c.stop()


@contextmanager
def paused(c: DevCluster):
    """The worker stopped (SIGSTOP) while the body queues messages for it."""
    pid = c.workers[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def steps(client: GenerateClient) -> int:
    return int(client.stats(timeout_s=SILENCE_S)["steps"])


def wait_idle(client: GenerateClient) -> None:
    deadline = time.monotonic() + END_S
    while (s := client.stats(timeout_s=SILENCE_S))["running"] or s["waiting"]:
        assert time.monotonic() < deadline, "the flood's requests never ended"
        time.sleep(0.5)


def test_a_ping_behind_a_flood_on_its_own_connection_waits_a_few_steps(cluster) -> None:
    c, ep = cluster
    client = GenerateClient(ep)
    client.sock.setsockopt(zmq.SNDHWM, 0)  # the whole flood queues here, ahead of the ping
    try:
        before = steps(client)
        with paused(c):
            for i in range(FLOOD):
                client.submit(make_prompt(8, i), max_tokens=2, ignore_eos=True, temperature=0.0)
            ping, stats = client.send("ping"), client.send("stats")
            sent = time.monotonic()
        ended, pong_at, answered_at_step = 0, 0.0, None
        while ended < FLOOD or not pong_at or answered_at_step is None:
            assert time.monotonic() - sent < END_S, f"{FLOOD - ended} flood requests never ended"
            msg = client.recv(SILENCE_S)
            assert msg is not None, f"the worker sent nothing for {SILENCE_S} s"
            reply = parse_reply(msg)
            if isinstance(reply, Pong) and reply.client_id == ping:
                pong_at = time.monotonic()
            elif isinstance(reply, StatsReply) and reply.client_id == stats:
                answered_at_step = int(reply.stats["steps"])
            elif isinstance(reply, ErrorMessage) or (isinstance(reply, TokenMessage) and reply.finished):
                ended += 1
        assert pong_at - sent < SILENCE_S, f"the ping waited {pong_at - sent:.1f} s behind the flood"
        # the stats right behind the ping were answered in the same read: the steps run meanwhile
        # (the old 256-message read: 78; ZeroMQ's receive pipe refills 1,000 at a time: at most 20)
        assert answered_at_step - before < FLOOD // 512, f"{answered_at_step - before} steps before the ping"
        wait_idle(client)
    finally:
        client.close()


def test_pings_from_another_client_are_answered_through_a_flood(cluster) -> None:
    """The issue's case: a good client pinging every 100 ms on its own connection."""
    c, ep = cluster
    flooder, good = GenerateClient(ep), GenerateClient(ep)
    flooder.sock.setsockopt(zmq.SNDHWM, 0)
    try:
        for i in range(FLOOD):
            flooder.submit(make_prompt(8, i), max_tokens=2, ignore_eos=True, temperature=0.0)
        waits, ended, deadline = [], 0, time.monotonic() + END_S
        while ended < FLOOD:
            assert time.monotonic() < deadline, f"{FLOOD - ended} flood requests never ended"
            t0 = time.monotonic()
            good.ping(timeout_s=SILENCE_S)  # raises past the bound
            waits.append(time.monotonic() - t0)
            while flooder.sock.poll(0):
                reply = parse_reply(msgpack.unpackb(flooder.sock.recv(), raw=False))
                ended += isinstance(reply, ErrorMessage) or (isinstance(reply, TokenMessage) and reply.finished)
            time.sleep(0.1)
        assert len(waits) > 1 and max(waits) < SILENCE_S
        wait_idle(good)
    finally:
        flooder.close()
        good.close()


def test_the_link_queues_what_a_paused_worker_cannot_take_yet(cluster) -> None:
    """More requests than ZeroMQ's pipes and the kernel hold while the worker is stopped: each
    reaches the worker in order once it runs again, none is lost, the link stays up."""
    c, ep = cluster
    n = 12_000

    async def run() -> dict[str, int]:
        ctx = zmq.asyncio.Context()
        link = WorkerLink(ep, ctx, silence_s=SILENCE_S)
        outcome = {"finished": 0, "refused": 0, "lost": 0}

        async def one(rid: str) -> None:
            try:
                while True:
                    reply = await link.next(rid)
                    if isinstance(reply, ErrorMessage):
                        outcome["refused"] += 1
                        return
                    if isinstance(reply, TokenMessage) and reply.finished:
                        outcome["finished"] += 1
                        return
            except WorkerLost:
                outcome["lost"] += 1
            finally:
                link.done(rid)

        try:
            await asyncio.sleep(0.5)  # connected
            with paused(c):
                rids = [link.submit(make_prompt(8, i), {"max_tokens": 2, "ignore_eos": True, "temperature": 0.0})
                        for i in range(n)]
                await asyncio.sleep(2.0)  # pings queue behind them meanwhile
            async with asyncio.timeout(END_S):
                await asyncio.gather(*(one(rid) for rid in rids))
            assert link.lost is None
            return outcome
        finally:
            await link.close()
            ctx.term()

    outcome = asyncio.run(run())
    assert outcome["lost"] == 0 and outcome["finished"] + outcome["refused"] == n, outcome
    assert outcome["finished"] >= 4096, outcome  # the worker's open limit: the rest may be refused
