"""The front door's link to a worker (client/generate_async.py ``WorkerLink``) against a real
ROUTER socket standing in for the worker: a burst of replies does not starve the event loop."""

from __future__ import annotations

import asyncio
import tempfile
import time

import zmq
import zmq.asyncio

from kvpool.client.generate_async import READ_BURST, WorkerLink
from kvpool.shared.generate import TokenMessage, decode, pack

BURST = 900  # within the link socket's receive high-water mark (1000): all of it waits there at once


def test_a_burst_of_replies_already_waiting_lets_the_event_loop_run_between_reads() -> None:
    """Every message of the burst is in the link's socket before the loop runs again, so a recv
    never has to wait: the reader must still yield, or timers (the front door's disconnect
    checks) and other requests wait for the whole burst."""
    with tempfile.TemporaryDirectory(prefix="kvpool-link-") as tmp:
        endpoint = f"ipc://{tmp}/worker.sock"
        sync_ctx = zmq.Context()
        router = sync_ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 0)
        router.bind(endpoint)

        async def run() -> list[int]:
            ctx = zmq.asyncio.Context()
            link = WorkerLink(endpoint, ctx, silence_s=120.0)
            try:
                rid = link.submit([1, 2, 3], {"max_tokens": BURST})
                assert router.poll(10_000), "the link's request never reached the worker"
                ident, payload = router.recv_multipart()
                assert decode(payload)["id"] == rid
                reply = pack(TokenMessage(rid, 0, 7).to_wire())
                for _ in range(BURST):
                    router.send_multipart([ident, reply])
                time.sleep(1.0)  # the loop is blocked: the whole burst reaches the link's socket
                seen: list[int] = []

                async def tick() -> None:
                    while True:
                        seen.append(link.queues[rid].qsize())
                        await asyncio.sleep(0)

                ticker = asyncio.create_task(tick())
                async with asyncio.timeout(30):
                    while link.queues[rid].qsize() < BURST:
                        await asyncio.sleep(0.001)
                ticker.cancel()
                return seen
            finally:
                await link.close()
                ctx.term()

        try:
            seen = asyncio.run(run())
        finally:
            router.close()
            sync_ctx.term()
    partial = [n for n in seen if 0 < n < BURST]
    assert partial, f"the loop ran only before and after the burst: {sorted(set(seen))}"
    assert len(partial) >= BURST // READ_BURST // 2  # about once every READ_BURST messages
