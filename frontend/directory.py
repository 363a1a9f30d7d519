"""Which workers serve which model, learned from one or more managers (one per node).

Every ``poll_s`` the directory asks each manager's ``workers`` op (PROTOCOL.md section 5) which
ready pools announced a generate endpoint, opens a ``WorkerLink`` to each new endpoint and fails
the open requests of a worker that dropped out (its session ended: killed, stopped, expired).
``locate_all`` asks a manager how many leading blocks of a hash chain each of its pools and
attached vLLM servers holds.

Manager calls are coroutines on the event loop (``AsyncManagerClient``, one call in flight per
manager): no thread, and the loop never blocks on a manager.

CURVE: ``manager_keys`` secure the manager connections (without them the client takes the
``KVPOOL_CURVE_*`` environment), ``worker_keys`` every worker link. A worker announced on a
non-loopback TCP endpoint while ``worker_keys`` is None is not connected to unless ``insecure``
(shared/bind.py ``check_connect``): its link stays lost, with the reason its requests' 503 says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq.asyncio

from kvpool.client.generate_async import WorkerLink
from kvpool.client.generate_core import MANAGER_GRACE_S, Outage
from kvpool.client.manager_async import AsyncManagerClient
from kvpool.shared.bind import check_connect
from kvpool.shared.curve import ClientKeys
from kvpool.shared.protocol import ManagerError
from kvpool.shared.summaries import WorkerRow

logger = logging.getLogger(__name__)


@dataclass
class Worker:
    """One pool that serves a model: what its manager said, and our link to it."""

    manager: int  # index into Directory.managers
    pool: str
    model: str
    endpoint: str
    max_model_len: int
    block_size: int
    num_blocks: int
    free_blocks: int
    epoch: int
    link: WorkerLink
    tokenizer: str | None = None  # the tokenizer's path when ``model`` is a served name

    @property
    def key(self) -> tuple[int, str]:
        return (self.manager, self.pool)

    @property
    def name(self) -> str:
        return self.pool if self.manager == 0 else f"{self.pool}@{self.manager}"


@dataclass
class External:
    """An external server (a `vllm serve` attached to a manager: manager/external/)."""

    manager: int
    name: str
    model: str
    url: str
    block_size: int
    stale: str | None  # the manager's mirror of its cache is not exact: no prefix credit
    failed_at: float = 0.0  # monotonic time it last failed a request here (taken out a while)
    polled: Polled | None = None  # its own /metrics as the manager last read it (None: not yet)

    @property
    def key(self) -> tuple[int, str]:
        return (self.manager, self.name)

    def take_out(self, now: float) -> None:
        """It failed a request: no new one for a while (frontend/vllm_proxy.py TAKE_OUT_S)."""
        self.failed_at = now


@dataclass(frozen=True)
class Polled:
    """An external server's load as its /metrics said (manager/external/probe.py), in this
    process's monotonic time."""

    at: float  # when the manager read it
    running: int
    waiting: int
    kv_usage: float  # fraction of its device blocks that running requests hold
    num_blocks: int | None  # its device blocks

    @staticmethod
    def of_row(row: dict, now: float) -> Polled | None:
        """From an ``externals`` row (None when the row has no load, or a malformed one)."""
        try:
            running, waiting, usage, age = row["running"], row["waiting"], row["kv_usage"], row["load_age_s"]
            blocks = row.get("num_blocks")
            if not all(type(v) is int and v >= 0 for v in (running, waiting)) or \
                    not all(isinstance(v, (int, float)) for v in (usage, age)) or \
                    (blocks is not None and (type(blocks) is not int or blocks <= 0)):
                return None
        except KeyError:
            return None
        return Polled(now - max(0.0, float(age)), running, waiting, min(1.0, max(0.0, float(usage))), blocks)


@dataclass
class Located:
    """One manager's ``locate`` answer: leading cached blocks per pool and per attached server."""

    pools: dict[str, int] = field(default_factory=dict)
    external: dict[str, int] = field(default_factory=dict)  # in each server's device tier
    external_cpu: dict[str, int] = field(default_factory=dict)  # after those, in its CPU tier


class Directory:
    def __init__(self, managers: list[str], *, poll_s: float = 0.5, silence_s: float = 30.0,
                 timeout_s: float = 2.0, manager_grace_s: float = MANAGER_GRACE_S,
                 manager_keys: ClientKeys | None = None,
                 worker_keys: ClientKeys | None = None, insecure: bool = False) -> None:
        if not managers:
            raise ValueError("the front door needs at least one manager endpoint (--manager)")
        self.endpoints = managers
        self.worker_keys, self.insecure = worker_keys, insecure
        self.ctx = zmq.asyncio.Context()
        self.clients = [AsyncManagerClient(ep.split(","), ctx=self.ctx, role="router", timeout_s=timeout_s,
                                           failover_s=timeout_s, curve=manager_keys) for ep in managers]
        self.poll_s, self.silence_s = poll_s, silence_s
        self.workers: dict[tuple[int, str], Worker] = {}
        self.externals: dict[tuple[int, str], External] = {}
        self.reachable = [False] * len(managers)  # answered its last poll, or failed them for less than the grace
        self.outages = [Outage(manager_grace_s) for _ in managers]
        self.draining = [False] * len(managers)  # the manager said so at the last poll (kvpool drain)
        self._task: asyncio.Task | None = None
        self.changes = 0

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 (the poller must outlive any one bad round)
                logger.exception("refreshing the worker list failed")

    async def refresh(self) -> None:
        for i, client in enumerate(self.clients):
            try:
                reply = await client.call("workers", retry=True)
            except ManagerError as e:
                lasted = self.outages[i].down(time.monotonic())
                if self.reachable[i] and lasted is not None:
                    logger.warning("manager %s: %s, for %.1f s (keeping its last known workers; new requests to "
                                   "them get 503 until it answers)", self.endpoints[i], e, lasted)
                    self.reachable[i] = False
                elif self.reachable[i]:
                    logger.info("manager %s: %s (within the %g s grace)", self.endpoints[i], e, self.outages[i].grace_s)
                continue
            self.outages[i].up()
            self.reachable[i] = True
            self.draining[i] = reply.get("draining") is True
            await self._apply(i, reply["workers"])
            await self._apply_externals(i, client)

    async def _apply_externals(self, i: int, client: AsyncManagerClient) -> None:
        try:
            rows = (await client.call("externals", retry=True))["externals"]
        except ManagerError as e:
            if e.code != "unknown_op":  # (a manager from before external pools: none)
                logger.warning("manager %s: externals: %s", self.endpoints[i], e)
            return
        seen = set()
        now = time.monotonic()
        for r in rows:
            key = (i, r["name"])
            seen.add(key)
            old = self.externals.get(key)
            if old is not None and (old.url, old.model) == (r["url"], r["model"]):
                old.stale, old.polled = r["stale"], Polled.of_row(r, now)
                continue
            self.externals[key] = External(i, r["name"], r["model"], r["url"], r["block_size"], r["stale"],
                                           polled=Polled.of_row(r, now))
            self.changes += 1
            logger.info("external server %s serves %s at %s", r["name"], r["model"], r["url"])
        for key in [k for k in self.externals if k[0] == i and k not in seen]:
            logger.info("external server %s detached", self.externals.pop(key).name)

    def external_models(self) -> dict[str, list[External]]:
        out: dict[str, list[External]] = {}
        for e in self.externals.values():
            out.setdefault(e.model, []).append(e)
        return out

    async def locate_all(self, manager: int, hashes: list[bytes]) -> Located:
        """Where one manager's pools and attached servers hold the chain (empty when it cannot say)."""
        if not hashes:
            return Located()
        try:
            body = await self.clients[manager].call("locate", retry=True, hashes=hashes)
        except ManagerError as e:
            logger.warning("locate at %s failed: %s", self.endpoints[manager], e)
            return Located()
        return Located(body.get("pools") or {}, body.get("external") or {}, body.get("external_cpu") or {})

    async def _apply(self, i: int, wire_rows: list[dict]) -> None:
        seen = set()
        for row in map(WorkerRow.from_wire, wire_rows):
            key = (i, row.pool)
            seen.add(key)
            old = self.workers.get(key)
            if old is not None and (old.endpoint, old.epoch) == (row.serve.endpoint, row.epoch):
                old.free_blocks, old.num_blocks = row.free_blocks, row.num_blocks
                continue  # a lost link stays lost until the worker re-registers (new epoch) or reconnects
            if old is not None:
                await self._drop(old, "re-registered")
            link = WorkerLink(row.serve.endpoint, self.ctx, self.silence_s, self.worker_keys, self._refusal(row))
            self.workers[key] = Worker(i, row.pool, row.serve.model, row.serve.endpoint, row.serve.max_model_len,
                                       row.block_size, row.num_blocks, row.free_blocks, row.epoch, link,
                                       row.serve.tokenizer)
            self.changes += 1
            logger.info("worker %s serves %s at %s", row.pool, row.serve.model, row.serve.endpoint)
        for key in [k for k in self.workers if k[0] == i and k not in seen]:
            await self._drop(self.workers.pop(key), "left its manager")

    def _refusal(self, row: WorkerRow) -> str | None:
        try:
            check_connect(row.serve.endpoint, curve=self.worker_keys is not None, insecure=self.insecure,
                          what=f"worker {row.pool!r} at")
        except ValueError as e:
            return f"not connected: {e}"
        return None

    async def _drop(self, w: Worker, why: str) -> None:
        logger.info("worker %s (%s) %s", w.pool, w.endpoint, why)
        self.workers.pop(w.key, None)
        self.changes += 1
        w.link.fail(why)
        await w.link.close()

    def serving(self, model: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.model == model and w.link.lost is None]

    def unavailable(self, w: Worker) -> str | None:
        """Why ``w`` cannot take a new request now (its manager is unreachable or draining), or None."""
        if not self.reachable[w.manager]:
            return "manager_unreachable"
        return "draining" if self.draining[w.manager] else None

    def models(self) -> dict[str, list[Worker]]:
        out: dict[str, list[Worker]] = {}
        for w in self.workers.values():
            out.setdefault(w.model, []).append(w)
        return out

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for w in list(self.workers.values()):
            await w.link.close()
        self.workers.clear()
        for c in self.clients:
            try:
                await c.deregister()
            except ManagerError:
                pass
            c.close()
        self.ctx.term()
