"""What a step's outcome does to its requests: the manager's answer to each sub-op, each drawn token.

``apply_answers`` gives each sub-op's answer to its request: its blocks entered in the running set
(worker/running_set.py), its ``kv`` view brought up to what the manager now holds, its ``step``
state told whether its admission went through. An answer for a request that moved on since the
plan was made (finished, aborted, lost: its step generation changed) is skipped. A refused fork
or extend loses its request (recomputed from scratch), unless the extend was refused for space:
the scheduler then preempts for it. An admission refused for space or draining goes back to the
waiting queue; one refused as bad input ends with an error.

``accept_tokens`` appends each drawn token to the request it goes to (an n > 1 request's other
samples become requests of their own at its first token) and ends the requests that reached an
EOS id, a stop id or their length.

What the outcome means for the next step (whom to preempt, whether admissions wait, whether the
manager drains) is the scheduler's policy (worker/scheduler.py): ``Answered`` tells it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.shared.step_ops import AllocResult, ExtendResult, Forked, Result
from kvpool.worker.request import Request
from kvpool.worker.running_set import RunningSet
from kvpool.worker.step_plan import Output, StepPlan, SubOp

logger = logging.getLogger(__name__)


@dataclass
class Answered:
    """What the manager's answers to one step's sub-ops did, for the scheduler's policy."""

    errored: list[Request] = field(default_factory=list)  # refused as bad input: they end with an error
    failed: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens) refused for space
    refused: list[Request] = field(default_factory=list)  # admissions refused for space or draining
    head_refused: bool = False  # the head of the waiting queue was refused for space
    # the last admission answered: refused for draining (True), went through (False); None: no such
    draining: bool | None = None


def apply_answers(requests: RunningSet, plan: StepPlan, results: list[Result], block_size: int) -> Answered:
    """Applies the manager's ``results`` for ``plan``'s sub-ops, in order."""
    out = Answered()
    head = next((sub.req for sub in plan.subops if sub.kind == "alloc"), None)  # the queue's head
    for sub, res in zip(plan.subops, results):
        req = sub.req
        if req is not None and req.step.generation != sub.generation:
            continue  # it moved on (finished, aborted, lost) after the plan was made
        if sub.kind == "free":
            if not res.ok and res.code != "unknown_request":  # type: ignore[union-attr]
                logger.warning("free refused: %s", res)
        elif sub.kind == "fork":
            _forked(requests, req, res, block_size)
        elif sub.kind in ("extend", "sync"):
            _extended(requests, sub, res, block_size, out.failed)
        elif not _allocated(requests, sub, res, block_size, out):
            out.errored.append(req)
        elif not res.ok and res.code == "no_space" and req is head:  # type: ignore[union-attr]
            out.head_refused = True
    return out


def _forked(requests: RunningSet, child: Request, res: Result, block_size: int) -> None:
    if type(res) is Forked:
        requests.set_blocks(child, res.blocks)
        child.kv.forked(block_size)
    else:
        logger.warning("fork of %r refused (%s): recomputing it", child, res.msg)  # type: ignore[union-attr]
        requests.lose(child)


def _extended(requests: RunningSet, sub: SubOp, res: Result, block_size: int, failed: list) -> None:
    req = sub.req
    if type(res) is ExtendResult:
        requests.add_blocks(req, res.blocks, [(index, dst) for index, _, dst in res.copies])
        req.kv.extended(sub.kind != "sync", block_size)  # a write went through: copied
        return
    req.kv.undo(sub.undo)
    if res.code == "no_space":  # type: ignore[union-attr]
        failed.append((req, sub.num_tokens))
    else:
        logger.warning("extend of %r refused (%s): recomputing it", req, res.msg)  # type: ignore[union-attr]
        requests.lose(req)


def _allocated(requests: RunningSet, sub: SubOp, res: Result, block_size: int, out: Answered) -> bool:
    """False: refused as bad input."""
    req = sub.req
    if type(res) is AllocResult:
        out.draining = False  # admissions go through again
        cached = res.cached  # a later step in flight may have moved the counts on: max
        req.step.admitted(cached)
        requests.set_blocks(req, res.blocks)
        req.kv.allocated(len(req.tokens), cached, sub.num_tokens, block_size)
        requests.count_admission(len(req.tokens), cached)
        return True
    req.step.refused()
    requests.withdraw(req)
    code = res.code  # type: ignore[union-attr]
    if code in ("no_space", "draining"):
        if code == "draining":
            out.draining = True
        out.refused.append(req)
        return True
    req.finish(f"error: {res.msg}")  # type: ignore[union-attr]
    return False


def accept_tokens(requests: RunningSet, outputs: list[Output], new_rid: Callable[[], int],
                  eos_token_ids: frozenset[int], max_model_len: int) -> list[Request]:
    """Appends each of ``outputs``' tokens to the request it goes to; returns the parallel samples
    spawned for them (each a request of its own, with a manager id from ``new_rid``), in order."""
    spawned: list[Request] = []
    for out in outputs:
        req = out.req
        if out.sample:
            req = req.new_sample(out.sample, new_rid())
            requests.spawn(out.req, req)
            spawned.append(req)
        elif req.holds_all_samples:
            req.split()  # its first token: the other samples are drawn with it
        if req.finish_reason is not None:
            continue  # aborted while its step ran
        req.append(out.token)
        reason = None
        if out.token in eos_token_ids and not req.params.ignore_eos:
            reason = "stop"
        elif out.token in req.params.stop_token_ids:
            reason = "stop"
        elif req.num_output >= req.params.max_tokens or len(req.tokens) >= max_model_len:
            reason = "length"
        if reason is not None:
            requests.finish(req, reason)
    return spawned
