"""Where the scheduler's block decisions are made: the manager, local or remote.

The scheduler only needs ``step(ops) -> results`` (one round trip per scheduler step, schemas as
in ``kvpool.manager.core.step``) plus registration around it; ``send_step``/``recv_step`` split
that round trip so the worker computes while the manager answers. ``LocalBlockManager`` embeds a real
``Pool`` and runs steps through ``run_step`` (tests, benchmarks); ``RemoteBlockManager`` talks to
the manager daemon through ``ManagerClient``. Both raise ``ManagerReset`` when the manager no
longer holds this worker's requests: the engine then re-registers and recomputes.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvpool.client.manager import ManagerClient
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.node_orders import NodeReport
from kvpool.shared.node_tier import NodeTierInfo, layout_id
from kvpool.shared.protocol import KVSpec, ManagerRestarted, ManagerUnavailable, StaleEpoch
from kvpool.shared.step_ops import Result, SubOp, decode_results, encode_ops

logger = logging.getLogger(__name__)


class ManagerReset(Exception):
    """The manager forgot this worker's requests (restart, new epoch): re-register, recompute."""


def spec_num_blocks(spec: KVSpec, available_kv_bytes: int) -> int:
    """Blocks of ``spec`` that fit ``available_kv_bytes`` (the same arithmetic as the manager's)."""
    return available_kv_bytes // spec.block_bytes


class BlockManager(Protocol):
    pool: str
    node_tier_capable: bool  # a node tier may come with registration (the engine then offers its model)

    def register(self, spec: KVSpec, available_kv_bytes: int, host_kv_bytes: int = 0,
                 host_kv_policy: str = "demote", node_model: str | None = None) -> dict: ...

    def step(self, ops: list[SubOp]) -> list[Result]: ...

    def send_step(self, ops: list[SubOp], node_done: Sequence[NodeReport] = ()) -> object: ...

    def node_done(self, reports: Sequence[NodeReport]) -> None: ...  # node-tier batches run (no step to carry them)

    def recv_step(self, ticket: object) -> list[Result]: ...

    def heartbeat(self) -> bool: ...  # True when the manager answered one just now

    def stats(self) -> dict: ...

    def deregister(self) -> None: ...

    def stop_retrying(self) -> None: ...

    def close(self) -> None: ...


class LocalBlockManager:
    """An in-process manager of one pool: the same Pool and step executor as the daemon."""

    def __init__(self, pool: str = "local", *, enable_caching: bool = True, max_blocks: int | None = None,
                 node_tier: tuple[NodeTier, NodeTierInfo] | None = None, shard: tuple[int, int] = (0, 1)):
        self.pool = pool
        # (rank, count) of the tensor-parallel shard this stands in for (tests give each rank
        # its own in-process manager; only rank 0's pool steps, so only it joins the node tier)
        self.shard = shard
        self.enable_caching = enable_caching
        self.max_blocks = max_blocks  # cap (tests that want memory pressure)
        self.epoch = 0
        self.draining = False  # as the daemon's drain: allocations are refused
        # a node tier shared with other in-process pools (tests, benchmarks): its bookkeeping and
        # where its stores live, as the daemon's registration hands them out
        self.node_tier = node_tier
        self.node_tier_capable = node_tier is not None
        self._pool: Pool | None = None

    def register(self, spec: KVSpec, available_kv_bytes: int, host_kv_bytes: int = 0,
                 host_kv_policy: str = "demote", node_model: str | None = None) -> dict:
        num_blocks = spec_num_blocks(spec, available_kv_bytes)
        if self.max_blocks is not None:
            num_blocks = min(num_blocks, self.max_blocks)
        host_blocks = host_kv_bytes // spec.block_bytes
        self._pool = Pool(num_blocks, spec.block_size, enable_caching=self.enable_caching, host_blocks=host_blocks,
                          host_policy=host_kv_policy)
        self.epoch += 1
        info = {"num_blocks": num_blocks, "block_size": spec.block_size, "epoch": self.epoch}
        if host_kv_bytes // spec.block_bytes:  # as the manager answers (PROTOCOL.md, register)
            info["host_num_blocks"] = host_kv_bytes // spec.block_bytes
            info["host_policy"] = host_kv_policy
        if self.node_tier is not None and node_model is not None:
            tier, where = self.node_tier
            rank, count = self.shard
            if layout_id(spec, node_model, 0, count).hex() == where.layout and where.world == count:
                if rank == 0:
                    self._pool.set_node(tier)
                info["node_tier"] = where.to_wire()
        return info

    def step(self, ops: list[SubOp]) -> list[Result]:
        if self._pool is None:
            raise ManagerReset(f"pool {self.pool!r} is not registered (manager restarted)")
        return run_step(self._pool, self.pool, ops, allow_alloc=not self.draining)

    def send_step(self, ops: list[SubOp], node_done: Sequence[NodeReport] = ()) -> object:
        """In process the answer is ready at once (the caller's overlap then costs nothing)."""
        self.node_done(node_done)
        return self.step(ops)

    def node_done(self, reports: Sequence[NodeReport]) -> None:
        if self.node_tier is not None:
            for r in reports:
                self.node_tier[0].finish((self.pool, r.batch), r.failed, r.late)

    def recv_step(self, ticket: object) -> list[Result]:
        return ticket  # type: ignore[return-value]

    def simulate_restart(self) -> None:
        """Forget everything, as a manager restarted without persistence would."""
        self._pool = None

    @property
    def core(self) -> Pool:
        if self._pool is None:
            raise ManagerReset("not registered")
        return self._pool

    def heartbeat(self) -> bool:
        return True  # in-process: always reachable

    def stats(self) -> dict:
        return self._pool.snapshot_stats() if self._pool is not None else {}

    def deregister(self) -> None:
        if self._pool is not None:
            self._pool.free_all()
        self._pool = None

    def stop_retrying(self) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteBlockManager:
    """The manager daemon over ``ManagerClient``: one round trip per step, heartbeats, re-joins.

    ``ManagerRestarted``/``SessionExpired``/``StaleEpoch`` become ``ManagerReset``. A step that
    got no reply (``ManagerUnavailable``) may or may not have run, so it is treated the same way,
    and the next registration opens a fresh session: the old one's blocks are freed when the
    manager expires it, and its request ids can never collide with the new ones.
    ``ManagerUnavailable`` from register/heartbeat propagates: the caller retries later.
    """

    def __init__(self, endpoints: str | list[str], pool: str, *, shard_rank: int = 0, shard_count: int = 1,
                 incarnation: str | None = None, timeout_s: float = 5.0, register_wait_s: float = 30.0,
                 identity: str | None = None, serve: dict | None = None, replace: bool = False,
                 receiver_thread: bool = True) -> None:
        # receiver_thread: a sent step's reply is read during the caller's compute (overlap on);
        # with overlap off the caller waits at once and a thread would only add a hop
        self.client = ManagerClient(endpoints, role="worker", identity=identity, timeout_s=timeout_s,
                                    receiver_thread=receiver_thread)
        self.serve = serve  # announced at registration: where this pool takes generate requests
        self.pool = pool
        self.shard_rank, self.shard_count = shard_rank, shard_count
        self.incarnation = incarnation or uuid.uuid4().hex  # new tensors, new incarnation
        self.register_wait_s = register_wait_s
        self.replace = replace  # take the shard over from a live session (the first registration only)
        self.epoch = 0
        self._fresh_session = False
        self.node_tier_capable = True  # the manager decides (it may run none)

    def register(self, spec: KVSpec, available_kv_bytes: int, host_kv_bytes: int = 0,
                 host_kv_policy: str = "demote", node_model: str | None = None) -> dict:
        if self._fresh_session:
            self.client.hello()
            self._fresh_session = False
        info = self.client.register(self.pool, shard_rank=self.shard_rank, shard_count=self.shard_count,
                                    incarnation=self.incarnation, spec=spec.to_wire(),
                                    available_kv_bytes=available_kv_bytes, host_kv_bytes=host_kv_bytes,
                                    host_kv_policy=host_kv_policy, node_model=node_model,
                                    wait_s=self.register_wait_s, serve=self.serve, replace=self.replace)
        self.replace = False  # a later re-registration must not take the pool back from a newer worker
        self.epoch = int(info["epoch"])
        return info

    def step(self, ops: list[SubOp]) -> list[Result]:
        return self.recv_step(self.send_step(ops))

    def send_step(self, ops: list[SubOp], node_done: Sequence[NodeReport] = ()) -> object:
        with self._resets():
            return ops, self.client.begin_step(self.pool, self.epoch, encode_ops(ops),
                                               [r.to_wire() for r in node_done])

    def node_done(self, reports: Sequence[NodeReport]) -> None:
        with self._resets():
            self.client.call("node_done", pool=self.pool, epoch=self.epoch, reports=[r.to_wire() for r in reports])

    def recv_step(self, ticket: object) -> list[Result]:
        ops, pending = ticket  # type: ignore[misc]
        with self._resets():
            return decode_results(ops, self.client.end_step(pending))

    @contextlib.contextmanager
    def _resets(self) -> Iterator[None]:
        try:
            yield
        except (ManagerRestarted, StaleEpoch) as e:
            raise ManagerReset(str(e)) from e
        except ManagerUnavailable as e:
            self._fresh_session = True
            self.client.forget_session()  # given up: no heartbeat may find the old session gone again
            raise ManagerReset(str(e)) from e

    def heartbeat(self) -> bool:
        """True when a heartbeat was sent and answered (False: none was due)."""
        try:
            return self.client.maybe_heartbeat()
        except ManagerRestarted as e:
            raise ManagerReset(str(e)) from e

    def stats(self) -> dict:
        return self.client.stats()

    def deregister(self) -> None:
        self.client.deregister()

    def stop_retrying(self) -> None:
        """Shutting down: no call is resent any more (a durable manager's failover window)."""
        self.client.stop_retrying()

    def close(self) -> None:
        self.client.close()
