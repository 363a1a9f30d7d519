"""AsyncManagerClient against a live server thread: the sync client's ops and errors, awaited."""

from __future__ import annotations

import asyncio

import pytest
from helpers.manager import SPEC, kv_bytes

from kvpool.client.manager import ManagerClient
from kvpool.client.manager_async import AsyncManagerClient
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.protocol import ManagerError, ManagerUnavailable, StaleEpoch


def test_register_step_locate_and_workers_awaited(live_server):
    live = live_server()

    async def run() -> None:
        c = AsyncManagerClient(live.endpoint)
        try:
            body = await c.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                                    available_kv_bytes=kv_bytes(64),
                                    serve={"endpoint": "ipc:///tmp/x.sock", "model": "m", "max_model_len": 64})
            assert body["num_blocks"] == 64 and c.sid is not None and c.session is not None
            hashes = hash_blocks(list(range(32)), SPEC["block_size"])
            ops = [{"op": "alloc", "req": 1, "hashes": hashes, "prompt_len": 32, "max_new": 1}]
            results = await c.step("p", body["epoch"], ops)
            assert results[0]["ok"] and results[0]["blocks"][0] == 1  # the first block handed out
            assert await c.locate(hashes) == {"p": 0}  # allocated, not yet cached (committed by a later step)
            rows = await c.workers()
            assert [(r["pool"], r["model"]) for r in rows] == [("p", "m")]
            assert (await c.stats())["pools"]["p"]["num_blocks"] == 64
            with pytest.raises(StaleEpoch):
                await c.step("p", body["epoch"] + 1, [])
            with pytest.raises(ManagerError) as ei:
                await c.call("no_such_op")
            assert ei.value.code == "unknown_op"
        finally:
            await c.deregister()
            c.close()
        assert c.sid is None

    asyncio.run(run())


def test_concurrent_calls_share_one_socket_one_at_a_time(live_server):
    live = live_server()
    with ManagerClient(live.endpoint) as w:
        w.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC, available_kv_bytes=kv_bytes(8))

    async def run() -> list:
        c = AsyncManagerClient(live.endpoint, role="router")
        try:
            return await asyncio.gather(*(c.locate([bytes([i]) * 32]) for i in range(20)))
        finally:
            c.close()

    assert asyncio.run(run()) == [{"p": 0}] * 20


def test_no_manager_is_unavailable_without_blocking_the_loop(sock_dir):
    async def run() -> float:
        c = AsyncManagerClient(f"ipc://{sock_dir}/nobody.sock", timeout_s=0.3, failover_s=0.3)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(tick())
        try:
            with pytest.raises(ManagerUnavailable, match="no reply to 'hello'"):
                await c.workers()
        finally:
            t.cancel()
            c.close()
        return ticks

    assert asyncio.run(run()) >= 10  # the loop kept running while the client waited
