"""Rank 0 drives the other tensor-parallel ranks: one broadcast command per scheduler step.

Rank 0 alone runs the scheduler, talks allocation with the manager and samples. Before each
forward pass it broadcasts the batch (``Batch``: token ids, positions, block tables and
copy orders; slot mappings follow from them), so every rank builds the same batch metadata, writes
its slice of the KV heads into the same slots and joins the same all-reduces. Commands::

    {"op": "register"}                                   every rank (re-)registers its shard
    {"op": "step", "seqs": [[ids, start, table, sample], ...], "copies": [[src, dst], ...],
     "saves"/"loads"/"writes": [[src, dst], ...], "node": {batch, pre, post}}  (node: its orders)
    {"op": "restart", "seqs": [[i, start, ids], ...]}    within a step: sequences moved back
    {"op": "tick"}                                       idle: rank 0 is alive; heartbeat
    {"op": "stop"}                                       deregister and exit

A command is a msgpack map in a uint8 tensor (no pickle): one broadcast of ``HEAD`` bytes (a
4-byte little-endian length, then the payload) and, for a longer payload, a second broadcast of
the rest. Rank 0 ticks at least every ``tick_s`` so that an idle follower's wait never reaches
the process group's timeout, and a dead peer is noticed within a tick: every collective then
fails and raises ``TPPeerLost``. Rank 0 stops (freeing its requests and deregistering); the
followers stop when rank 0 is gone. The manager moves the pool's epoch on when a shard's session
ends or a shard comes back as a new incarnation, so no rank ever serves the lost slice's cache.

The node tier (worker/node_copier.py) has one store per rank, each holding its slice of every
block under one slot number; a block moved only if it moved on every rank. So each rank runs the
step's node orders on its own store and the ranks agree on the outcome (worker/node_agreement.py): a
sum over the ranks of each order's failed and late flags, and a block that any rank could not
load is recomputed by all of them. The sequences that moves back are rank 0's to say (a follower
holds no request's tokens): it sends them in a ``restart`` command inside the step.
"""

from __future__ import annotations

import logging
import signal
import time

import msgpack
import torch
import torch.distributed as dist

from kvpool.shared.node_orders import NodeOrders
from kvpool.shared.node_tier import READ_TIMEOUT_S, NodeTierInfo
from kvpool.shared.protocol import ManagerError, ManagerRestarted
from kvpool.worker.block_manager import BlockManager, ManagerReset
from kvpool.worker.kv_cache import kv_spec
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.node_agreement import NodeAgreement
from kvpool.worker.node_copier import map_stores
from kvpool.worker.parallel import TPPeerLost
from kvpool.worker.profiler import check_fits
from kvpool.worker.runner import ModelRunner, allocate_runner
from kvpool.worker.step_plan import Batch, BatchSeq

logger = logging.getLogger(__name__)
HEAD = 4096


def encode_plan(plan: Batch) -> dict:
    out = {"op": "step", "seqs": [[s.token_ids, s.start, s.block_table, s.sample] for s in plan.seqs],
           "copies": [list(c) for c in plan.copies], "saves": [list(c) for c in plan.saves],
           "loads": [list(c) for c in plan.loads], "writes": [list(c) for c in plan.writes]}
    if plan.node_batch is not None:
        out["node"] = NodeOrders(plan.node_batch, plan.node_pre, plan.node_post).to_wire()
    return out


def decode_plan(msg: dict) -> Batch:
    node = NodeOrders.from_wire(msg["node"]) if "node" in msg else None
    return Batch([BatchSeq(ids, start, table, sample) for ids, start, table, sample in msg["seqs"]],
                 [(src, dst) for src, dst in msg["copies"]],
                 saves=[(s, d) for s, d in msg.get("saves", ())], loads=[(s, d) for s, d in msg.get("loads", ())],
                 writes=[(s, d) for s, d in msg.get("writes", ())],
                 node_pre=node.pre if node else [], node_post=node.post if node else [],
                 node_batch=node.batch if node else None)


class Channel:
    """Rank 0 -> every other rank of the replica: msgpack maps over torch.distributed broadcast."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # gloo broadcasts CPU tensors, nccl CUDA ones

    def send(self, msg: dict) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        head = bytearray(HEAD)
        head[:4] = len(data).to_bytes(4, "little")
        head[4:4 + len(data)] = data[: HEAD - 4]
        self._broadcast(torch.frombuffer(head, dtype=torch.uint8), "send a command")
        if len(data) > HEAD - 4:
            self._broadcast(torch.frombuffer(bytearray(data[HEAD - 4 :]), dtype=torch.uint8), "send a command")

    def recv(self) -> dict:
        head = self._broadcast(torch.empty(HEAD, dtype=torch.uint8), "receive rank 0's command")
        raw = head.cpu().numpy().tobytes()
        size = int.from_bytes(raw[:4], "little")
        data = raw[4 : 4 + size]
        if size > HEAD - 4:
            rest = self._broadcast(torch.empty(size - (HEAD - 4), dtype=torch.uint8), "receive rank 0's command")
            data += rest.cpu().numpy().tobytes()
        return msgpack.unpackb(data, raw=False)

    def _broadcast(self, t: torch.Tensor, what: str) -> torch.Tensor:
        t = t.to(self.device)
        try:
            dist.broadcast(t, src=0)
        except RuntimeError as e:
            raise TPPeerLost(f"could not {what}: a tensor-parallel rank died or went silent ({e})") from e
        return t


class TPLeader:
    """Rank 0's side: tells the other ranks to register, run a step, stay alive, stop."""

    def __init__(self, channel: Channel, size: int, tick_s: float = 1.0) -> None:
        self.channel, self.size, self.tick_s = channel, size, tick_s
        self._last = time.monotonic()

    def register(self) -> None:
        self._send({"op": "register"})

    def run(self, plan: Batch) -> None:
        self._send(encode_plan(plan))

    def tick(self) -> None:
        if time.monotonic() - self._last >= self.tick_s:
            self._send({"op": "tick"})

    def stop(self) -> None:
        """Tells the other ranks to deregister and exit (they may already be gone)."""
        try:
            self._send({"op": "stop"})
        except TPPeerLost as e:
            logger.warning("could not tell the other ranks to stop: %s", e)

    def _send(self, msg: dict) -> None:
        self.channel.send(msg)
        self._last = time.monotonic()


class TPFollower:
    """A rank > 0: registers its shard, runs rank 0's plans on its slice, heartbeats.

    ``run`` returns when rank 0 says stop, or ``stop_grace_s`` after a SIGTERM/SIGINT (rank 0
    normally says stop first); it raises ``TPPeerLost`` when rank 0 is gone.
    """

    def __init__(self, model: LlamaForCausalLM, bm: BlockManager, channel: Channel, *, block_size: int,
                 available_kv_bytes: int, max_model_len: int, stop_grace_s: float = 5.0,
                 host_kv_bytes: int = 0, host_kv_policy: str = "demote", node_model: str | None = None,
                 node_read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.model, self.bm, self.channel = model, bm, channel
        # the weights' identity, offered at registration as rank 0 offers it: the manager then
        # names the node tier, and this rank maps its own stores of it (None: no node tier)
        self.node_model, self.node_read_timeout_s = node_model, node_read_timeout_s
        self.node_tier: NodeTierInfo | None = None
        self.block_size, self.max_model_len = block_size, max_model_len
        self.available_kv_bytes = available_kv_bytes
        self.host_kv_bytes = host_kv_bytes
        self.host_kv_policy = host_kv_policy
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.spec = kv_spec(model.config, block_size, self.dtype, model.tp_size)
        self.stop_grace_s = stop_grace_s
        self.num_blocks = 0
        self.runner: ModelRunner | None = None
        self.steps = 0
        self._stop_at: float | None = None

    def request_stop(self, *_: object) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic()

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        self.follow()

    def follow(self) -> None:
        """Runs rank 0's commands until it says stop (``run`` without the signal handlers)."""
        rank = self.model.tp_rank
        logger.info("tensor-parallel rank %d following rank 0", rank)
        try:
            while self.handle(self.channel.recv()):
                self._heartbeat()
                if self._stop_at is not None and time.monotonic() - self._stop_at > self.stop_grace_s:
                    logger.warning("rank %d: asked to stop and rank 0 did not say stop; leaving", rank)
                    return
        finally:
            self.shutdown()

    def handle(self, msg: dict) -> bool:
        """Runs one command; False on stop."""
        op = msg.get("op")
        if op == "step":
            if self.runner is None:
                raise RuntimeError(f"rank 0 sent a step before rank {self.model.tp_rank} could register its shard")
            self.runner.execute(decode_plan(msg), sample=False)
            self.runner.take_node_reports()  # rank 0 reports the pool's (the ranks agreed on them)
            self.steps += 1
        elif op == "register":
            self.register()
        elif op == "stop":
            return False
        elif op != "tick":
            raise RuntimeError(f"rank 0 sent an unknown command {op!r}")
        return True

    def register(self) -> None:
        """Registers this shard (its own memory, its slice's spec) and sizes its KV tensors to
        the pool's num_blocks. A failure is logged: rank 0's registration fails with it."""
        node = {"node_model": self.node_model} if self.node_model is not None else {}
        try:
            try:
                info = self.bm.register(self.spec, self.available_kv_bytes, self.host_kv_bytes, self.host_kv_policy,
                                        **node)
            except ManagerRestarted:  # our session had expired: the retry opens a new one
                info = self.bm.register(self.spec, self.available_kv_bytes, self.host_kv_bytes, self.host_kv_policy,
                                        **node)
        except ManagerError as e:
            logger.warning("rank %d could not register its shard: %s", self.model.tp_rank, e)
            return
        num_blocks = int(info["num_blocks"])
        check_fits(num_blocks, self.block_size, self.max_model_len)
        if num_blocks != self.num_blocks:
            if self.runner is not None:
                self.runner.attach_host(0)  # its host copies finish before its tensors go
            self.runner = None  # drop the old tensors before allocating new ones
            self.runner = allocate_runner(self.model, num_blocks, self.block_size)
            self.num_blocks = num_blocks
        self.runner.attach_host(int(info.get("host_num_blocks", 0)))  # type: ignore[union-attr]
        self._attach_node(info.get("node_tier"))
        logger.info("rank %d registered its shard of pool %s: %d blocks, %d KV bytes", self.model.tp_rank,
                    self.bm.pool, num_blocks, self.runner.kv_bytes)  # type: ignore[union-attr]

    def _attach_node(self, wire: object) -> None:
        """Maps this rank's stores of the node tier the manager named (as rank 0 does: Engine)."""
        runner = self.runner
        info = None if wire is None else NodeTierInfo.from_wire(wire)
        if info is not None and info == self.node_tier and runner.node is not None:  # type: ignore[union-attr]
            return
        node = map_stores(runner.kv_caches, info, self.spec, self.node_model or "", self.model.tp_rank,  # type: ignore[union-attr]
                          self.model.tp_size, self.node_read_timeout_s)
        agree = NodeAgreement(self.model.reduce, self.channel, False, self.device) if node else None
        runner.attach_node(node, agree)  # type: ignore[union-attr]
        self.node_tier = info

    def _heartbeat(self) -> None:
        try:
            self.bm.heartbeat()
        except ManagerReset as e:  # rank 0 notices too (stale epoch or restart) and says register
            logger.warning("rank %d lost its manager session (%s); re-registering with rank 0", self.model.tp_rank, e)
        except ManagerError as e:
            logger.warning("rank %d heartbeat failed: %s", self.model.tp_rank, e)

    def shutdown(self) -> None:
        try:
            self.bm.deregister()
        except ManagerError as e:
            logger.warning("rank %d could not deregister: %s", self.model.tp_rank, e)
        self.bm.close()
