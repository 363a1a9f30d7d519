"""The records of one scheduler step: what it asks the manager, and the batch the runner executes.

``Scheduler.schedule()`` returns a ``StepPlan``: the step message's sub-ops (``ops``, records of
shared/step_ops.py), what each one is for (``subops``, aligned with ``ops``) and the sequences it means to run (``seqs``; a
sequence whose tokens fit blocks it already holds points at no sub-op). The manager's answers
turn the plan into a ``Batch`` (``plan.batch(results)``: no state changes), the plain data the
runner executes and tensor-parallel rank 0 broadcasts. ``Scheduler.update(plan, results,
outputs)`` then applies the answers and the sampled tokens (``Output``, one per token) and says
what it did (``Updated``).

A plan entry remembers its request's ``generation`` (worker/step_state.py); a request that
finished, was aborted or lost its KV since (preempted, refused) has moved on, and the entry no
longer counts.

The records built per running request per step (``ScheduledSeq``, ``SubOp``, ``BatchSeq``,
``Output``) are slotted dataclasses and not frozen, though nothing changes them once built: a
frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` and took 0.68 µs
against 0.17 µs, four of them per running request per step (scripts/bench_sched.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvpool.shared.node_orders import Order
from kvpool.shared.step_ops import AllocResult, ExtendResult, Forked, Result
from kvpool.shared.step_ops import SubOp as StepOp
from kvpool.worker.kv_view import Undo
from kvpool.worker.request import Request
from kvpool.worker.step_state import StepState


@dataclass(slots=True)
class Output:
    """A token sampled for ``req``. ``sample``: which of its n samples the token is: 0, its own;
    1..n-1 only while ``req`` holds all its samples (its first token): the scheduler's
    ``update`` then spawns that sample as a request of its own, which the token goes to."""

    req: Request
    token: int
    sample: int = 0
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class Updated:
    """What ``Scheduler.update`` did with a step's answers and tokens."""

    errored: list[Request]  # refused as bad input: they end with an error
    spawned: list[Request]  # the requests spawned for the outputs with a ``sample``, in their order

    def receivers(self, outputs: list[Output]) -> Iterator[Request]:
        """The request each of ``outputs`` went to: its own, or the one spawned for it."""
        spawned = iter(self.spawned)
        for out in outputs:
            yield next(spawned) if out.sample else out.req


@dataclass(slots=True)
class BatchSeq:
    """One sequence's share of a forward pass: plain data, so a batch can be broadcast."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0] (tokens before it are in the cache)
    block_table: list[int]
    sample: bool  # the step reaches the sequence's last known token: sample the next one

    def start_at(self, start: int, token_ids: list[int]) -> None:
        """Computes from ``start`` instead (a block of its cached context was never written)."""
        self.start, self.token_ids = start, token_ids


@dataclass
class Batch:
    seqs: list[BatchSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    # the host tier's orders (manager/core/host_tier.py): every save, then every load, then
    # copies and the forward pass, then every write (write-through of blocks it filled)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    writes: list[tuple[int, int]] = field(default_factory=list)  # (device, host), after the forward
    # the node tier's orders (worker/node_copier.py): pre before the forward, post after it;
    # node_batch: the step's batch, reported done once they ran (None: no order)
    node_pre: list[Order] = field(default_factory=list)
    node_post: list[Order] = field(default_factory=list)
    node_batch: int | None = None
    reqs: list[Request] = field(default_factory=list)  # the request of each seq (rank 0 only)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class SubOp:
    """One sub-op of the step message (``op``, the record sent) and what it is for."""

    op: StepOp
    kind: str  # "fork" (req: the child), "free", "sync", "extend", "alloc"
    req: Request | None
    generation: int = 0
    num_tokens: int = 0  # extend: tokens it computes; alloc: max_new
    undo: Undo = (0, 0, 0)  # extend: the manager's view before it (worker/kv_view.py)


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step in flight (worker/step_state.py's ``launch`` and ``land``
    count it in and out of ``step``, its request's step state)."""

    req: Request
    step: StepState
    generation: int
    num_tokens: int  # tokens to compute (an alloc: at most; its cached prefix is skipped)
    start: int  # position of the first (an alloc: the manager's cached count decides)
    op: int  # index of its sub-op in ops; -1: none needed (its tokens fit blocks it holds)
    sample: bool = False  # reaches the last known token (an alloc: decided by its cached count)


@dataclass
class StepPlan:
    ops: list[StepOp] = field(default_factory=list)  # the message: subops[i].op is ops[i]
    subops: list[SubOp] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)

    def add(self, sub: SubOp) -> int:
        self.ops.append(sub.op)
        self.subops.append(sub)
        return len(self.ops) - 1

    def join(self, extra: StepPlan) -> None:
        """Appends ``extra`` (sent to the manager after this plan: its answers follow this
        plan's in the results)."""
        base = len(self.ops)
        for s in extra.seqs:
            if s.op >= 0:
                s.op += base
        self.ops += extra.ops
        self.subops += extra.subops
        self.seqs += extra.seqs

    def runnable(self, results: list[Result]) -> Iterator[tuple[ScheduledSeq, int, int, Result | None]]:
        """(seq, start, num_tokens, its sub-op's result) of every sequence that runs: its request
        has not moved on and its sub-op, if it needed one, succeeded."""
        for s in self.seqs:
            if s.step.generation != s.generation:
                continue
            res = results[s.op] if s.op >= 0 else None
            if res is not None and not res.ok:
                continue
            if type(res) is AllocResult:
                start = res.cached
                yield s, start, min(s.num_tokens, len(s.req.tokens) - start), res
            else:
                yield s, s.start, s.num_tokens, res

    def batch(self, results: list[Result]) -> Batch:
        """The forward pass the answers allow: block tables with the new blocks and
        copy-on-write replacements, refused and moved-on sequences left out."""
        out = Batch()
        for r in results:  # every order of the step, whoever's sequence runs: the manager counts on them
            if type(r) is AllocResult or type(r) is ExtendResult:
                if r.saves:
                    out.saves.extend((s, d) for s, d in r.saves)
                if r.loads:
                    out.loads.extend((s, d) for s, d in r.loads)
                if r.writes:
                    out.writes.extend((s, d) for s, d in r.writes)
                if r.node is not None:
                    out.node_pre += r.node.pre
                    out.node_post += r.node.post
                    out.node_batch = r.node.batch
        forked = {id(sub.req): r.blocks for sub, r in zip(self.subops, results) if type(r) is Forked}
        for s, start, n, res in self.runnable(results):
            req = s.req
            held = forked.get(id(req), req.kv.block_table)  # a child forked by this same message
            if res is None:
                table = list(held)
            elif type(res) is AllocResult:
                table = list(res.blocks)
            else:
                table = held + res.blocks  # type: ignore[union-attr]
                for index, src, dst in res.copies:  # type: ignore[union-attr]
                    table[index] = dst
                    out.copies.append((src, dst))
            end = start + n
            out.seqs.append(BatchSeq(req.tokens[start:end], start, table, end == len(req.tokens)))
            out.reqs.append(req)
        return out
