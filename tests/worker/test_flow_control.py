"""Flow control on the generate socket: a client that reads slower than the worker sends loses
nothing. A real worker process and a real DEALER that stops reading until every request has
finished on the worker, with far more token messages waiting than ZeroMQ's pipes hold; then
every request's every token and its final message arrive, in order. And the front door's link
reconciles its open requests with the worker's on every ping."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq.asyncio
from helpers.worker import make_prompt

from kvpool.client.generate import GenerateClient
from kvpool.client.generate_async import WorkerLink
from kvpool.client.generate_core import WorkerLost
from kvpool.devcluster.cluster import ClusterConfig, DevCluster
from kvpool.shared.generate import TokenMessage, parse_reply

pytestmark = pytest.mark.slow
REQUESTS, TOKENS = 96, 400  # 38,400 token messages: several times what the pipes between hold
BOUND_S = 240.0


@pytest.fixture(scope="module")
def cluster():
    c = DevCluster(ClusterConfig(num_workers=1, kv_blocks=4096, max_model_len=1024), prefix="kvpool-flow-")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def worker_idle(endpoint: str) -> bool:
    probe = GenerateClient(endpoint)
    try:
        stats = probe.call("stats")["stats"]
        return stats["running"] == 0 and stats["waiting"] == 0
    finally:
        probe.close()


def test_a_client_that_does_not_read_loses_no_token(cluster) -> None:
    ep = cluster.worker_eps[0]
    slow = GenerateClient(ep)
    try:
        slow.sock.setsockopt(zmq.RCVHWM, 100)  # a small pipe on our side too
        rids = [slow.submit(make_prompt(8, i), max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
                for i in range(REQUESTS)]
        deadline = time.monotonic() + BOUND_S
        time.sleep(1.0)
        while not worker_idle(ep):  # not one message read meanwhile
            assert time.monotonic() < deadline, "the worker did not finish the requests"
            time.sleep(0.5)
        tokens = {rid: 0 for rid in rids}
        finished = set()
        while len(finished) < REQUESTS:
            assert slow.sock.poll(int(BOUND_S * 1000)), f"{REQUESTS - len(finished)} requests never finished"
            reply = parse_reply(msgpack.unpackb(slow.sock.recv(), raw=False))
            if isinstance(reply, TokenMessage):
                assert reply.client_id not in finished, "a message after the request's last one"
                tokens[reply.client_id] += reply.token is not None
                if reply.finished:
                    finished.add(reply.client_id)
        assert tokens == {rid: TOKENS for rid in rids}
    finally:
        slow.close()


def test_the_link_fails_a_request_the_worker_no_longer_knows(cluster) -> None:
    """A request whose messages are lost (here: aborted behind the link's back) fails at the next
    ping instead of waiting for ever and counting as the worker's load."""
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        link = WorkerLink(cluster.worker_eps[0], ctx, silence_s=120.0)
        try:
            rid = link.submit(make_prompt(8, 1), {"max_tokens": 1000, "ignore_eos": True, "temperature": 0.0})
            await asyncio.wait_for(link.next(rid), 60)  # it runs
            link._send(link._core.control("abort", rid)[1])  # the worker forgets it; the link does not know
            assert link.running == 1
            with pytest.raises(WorkerLost, match="no longer knows"):
                while True:
                    await asyncio.wait_for(link.next(rid), 30)  # the tokens already sent, then the failure
            link.done(rid)
            assert link.running == 0
            ok = link.submit(make_prompt(8, 2), {"max_tokens": 3, "temperature": 0.0})  # the link serves on
            got = [await asyncio.wait_for(link.next(ok), 60) for _ in range(3)]
            assert got[-1].finished
        finally:
            await link.close()
            ctx.term()

    asyncio.run(run())
