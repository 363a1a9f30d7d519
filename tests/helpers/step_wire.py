"""A step on wire maps in process: what the daemon does with a step's ``ops`` (decode, run,
encode), for tests written against the wire forms of PROTOCOL.md section 6."""

from __future__ import annotations

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.step import run_step
from kvpool.shared.step_ops import decode_ops, encode_results


def run_wire_step(pool: Pool, owner: object, ops: list, allow_alloc: bool = True) -> list[dict]:
    return encode_results(run_step(pool, owner, decode_ops(ops), allow_alloc))
