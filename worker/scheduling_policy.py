"""The scheduler's two estimates, pure functions of the running requests: how many blocks an
admission may take, and whom to preempt when the manager refuses running requests for space.

Both are policies on our own holdings: which blocks, and whether they fit, the manager decides.
They change nothing; worker/scheduler.py acts on their answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.worker.kv_view import cdiv
from kvpool.worker.request import Request

UNKNOWN_ROOM = 1 << 62  # before registration the pool's size is unknown: the manager decides


def admission_room(running: Sequence[Request], num_blocks: int | None, block_size: int, static: bool,
                   held: int) -> int:
    """Blocks an admission may take and still leave every running request one block to
    grow into: an estimate from the ``held`` distinct blocks our requests hold (cache hits not
    counted), so admissions stop before decodes start to preempt. The manager still decides.
    Statically preallocated requests hold their whole max_model_len already and never grow."""
    if num_blocks is None:
        return UNKNOWN_ROOM
    held += sum(r.kv.num_slots // block_size for r in running if r.step.admitting)  # answers in flight
    growth = 0 if static else len(running)
    return num_blocks - 1 - held - growth


def blocks_short(req: Request, num_tokens: int, block_size: int) -> int:
    """Blocks ``req`` lacks to compute ``num_tokens`` more."""
    return max(0, cdiv(req.step.num_computed + num_tokens, block_size) - len(req.kv.block_table))


def choose_victims(running: Sequence[Request], failed: Sequence[tuple[Request, int]], block_size: int) -> list[Request]:
    """Newest-first running requests whose held blocks cover what the refused ``failed``
    (request, tokens) lacked: an estimate, the manager stays the judge (a shortfall fails
    again next step). A refused request counts what it holds and what it lacked."""
    short = {req: blocks_short(req, n, block_size) for req, n in failed}
    need = sum(short.values())
    victims = []
    for victim in reversed(list(running)):
        if need <= 0:
            break
        victims.append(victim)
        need -= len(victim.kv.block_table) + short.get(victim, 0)
    return victims
