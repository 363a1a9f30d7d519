"""In-process tensor parallelism for tests: ranks as threads, an all-reduce on a barrier, and a
queue in place of the broadcast channel. The real transport is tested across processes in
test_tensor_parallel_procs.py."""

from __future__ import annotations

import queue
import threading

import msgpack
import torch

from helpers.node_tier import MODEL
from helpers.worker import TINY
from kvpool.manager.core.node_tier import NodeTier
from kvpool.shared.node_tier import NodeTierInfo
from kvpool.worker.block_manager import LocalBlockManager
from kvpool.worker.engine import Engine
from kvpool.worker.model import LlamaForCausalLM, ReduceFn, build_model
from kvpool.worker.parallel import shard_model
from kvpool.worker.profiler import page_bytes
from kvpool.worker.scheduler import Scheduler
from kvpool.worker.tp import TPFollower, TPLeader

TIMEOUT_S = 60.0


class ThreadGroup:
    """An all-reduce between ``size`` threads: every rank sums the same tensors in rank order,
    so all get bitwise the same result (as gloo gives every rank the same sum)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * size

    def reduce_fn(self, rank: int) -> ReduceFn:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)  # type: ignore[arg-type]
            self.barrier.wait()  # nobody overwrites a slot before everyone has summed
            return total

        return reduce


class QueueChannel:
    """Rank 0 -> followers through queues, msgpack-encoded like the real channel."""

    def __init__(self, followers: int) -> None:
        self.queues = [queue.Queue() for _ in range(followers)]
        self.rank = 0
        self._holding = False  # a follower holds a command it has not finished handling

    def send(self, msg: dict) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        for q in self.queues:
            q.put(data)

    def follower(self, rank: int) -> QueueChannel:
        view = QueueChannel(0)
        view.queues, view.rank = self.queues, rank
        return view

    def recv(self) -> dict:
        q = self.queues[self.rank - 1]
        if self._holding:
            q.task_done()  # asking for the next command: the previous one is handled
        data = q.get(timeout=TIMEOUT_S)
        self._holding = True
        return msgpack.unpackb(data, raw=False)

    def wait_handled(self) -> None:
        """Returns once every follower has handled every command sent so far."""
        for q in self.queues:
            q.join()


def sharded_models(size: int, seed: int = 0) -> list[LlamaForCausalLM]:
    group = ThreadGroup(size)
    return [shard_model(build_model(TINY, torch.float32, "cpu", seed), r, size, reduce=group.reduce_fn(r))
            for r in range(size)]


def rank_kv_bytes(num_blocks: int, size: int, block_size: int = 16) -> int:
    """KV bytes one rank of ``size`` needs for ``num_blocks`` blocks of the tiny model."""
    return num_blocks * page_bytes(block_size, TINY.num_kv_heads // size, TINY.head_size, torch.float32) \
        * TINY.num_layers


class TPPair:
    """Rank 0's engine on this thread, the other ranks' followers on threads."""

    def __init__(self, num_blocks: int = 256, *, size: int = 2, max_blocks: int | None = None,
                 max_model_len: int = 256, max_num_batched_tokens: int = 512, host_blocks: int = 0,
                 host_kv_policy: str = "demote", overlap: bool = True,
                 node_tier: tuple[NodeTier, NodeTierInfo] | None = None, pool: str = "test") -> None:
        """``node_tier``: the tier (tests/helpers/node_tier.py ``tp_node_tier``) every rank maps
        its store of; rank 0's in-process manager hands out its orders."""
        models = sharded_models(size)
        channel = QueueChannel(size - 1)
        kv = rank_kv_bytes(num_blocks, size)
        host = {"host_kv_bytes": rank_kv_bytes(host_blocks, size), "host_kv_policy": host_kv_policy}
        if node_tier is not None:
            host["node_model"] = MODEL
        self.followers = [TPFollower(models[r], LocalBlockManager(f"{pool}-rank{r}", max_blocks=max_blocks,
                                                                  node_tier=node_tier, shard=(r, size)),
                                     channel.follower(r), block_size=16, available_kv_bytes=kv,
                                     max_model_len=max_model_len, **host) for r in range(1, size)]
        self.threads = [threading.Thread(target=f.follow, daemon=True) for f in self.followers]
        for t in self.threads:
            t.start()
        sched = Scheduler(16, max_num_batched_tokens, 64, max_model_len, eos_token_ids=models[0].config.eos_token_ids)
        self.channel = channel
        self.engine = Engine(models[0], LocalBlockManager(pool, max_blocks=max_blocks, node_tier=node_tier,
                                                          shard=(0, size)), sched, kv,
                             tp=TPLeader(channel, size), overlap=overlap, **host)  # type: ignore[arg-type]
        self.settle()  # the followers registered too (each has its own in-process manager)

    def count_forwards(self) -> list:
        """From now on every batch rank 0's runner executes is appended to the list returned."""
        forwards: list = []
        execute = self.engine.runner.execute
        self.engine.runner.execute = lambda plan: forwards.append(plan) or execute(plan)
        return forwards

    def settle(self) -> None:
        """Waits until the followers have run every command rank 0 sent (no sleeps)."""
        self.channel.wait_handled()

    def close(self) -> None:
        self.engine.shutdown()  # tells the followers to stop
        for t in self.threads:
            t.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in self.threads)
