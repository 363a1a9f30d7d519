"""The ranks of a tensor-parallel pool agree on each node-tier run (worker/tp.py's docstring
says why): an order landed only if it landed on every rank, and a block any rank could not load
is recomputed on all of them."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpool.shared.node_orders import Order
from kvpool.worker.model import ReduceFn
from kvpool.worker.node_copier import recompute
from kvpool.worker.step_plan import Batch


class Messages(Protocol):
    """Rank 0 -> the other ranks (worker/tp.py ``Channel``)."""

    def send(self, msg: dict) -> None: ...

    def recv(self) -> dict: ...


class NodeAgreement:
    """One outcome of each node-tier run for all the ranks of a tensor-parallel pool (module
    docstring). Rank 0 (``leader``) sends the sequences a failed load moves back; the others
    receive them."""

    def __init__(self, reduce: ReduceFn, channel: Messages, leader: bool, device: torch.device) -> None:
        self.reduce, self.channel, self.leader, self.device = reduce, channel, leader, device

    def outcomes(self, orders: list[Order], failed: list[Order], late: list[Order]) -> tuple[list[Order], list[Order]]:
        """The orders that failed (or were late: missed a disk deadline) on any rank. Every rank
        passes the same ``orders`` (rank 0's plan) and gets the same lists back."""
        n = len(orders)
        flags = torch.zeros(2 * n, dtype=torch.int32)
        at = {id(o): i for i, o in enumerate(orders)}
        for o in failed:
            flags[at[id(o)]] = 1
        for o in late:
            flags[n + at[id(o)]] = 1
        total = (self.reduce(flags.to(self.device)).cpu() > 0).tolist()
        gone, slow = total[:n], total[n:]
        return ([o for o, f in zip(orders, gone, strict=True) if f],
                [o for o, f, lt in zip(orders, gone, slow, strict=True) if lt and not f])

    def restart(self, plan: Batch, unwritten: set[int], block_size: int) -> int:
        """Moves back every sequence that reads an ``unwritten`` block (rank 0 decides and says
        which, the others apply it); returns the tokens added."""
        if self.leader:
            before = [s.start for s in plan.seqs]
            added = recompute(plan, unwritten, block_size)
            self.channel.send({"op": "restart", "seqs": [[i, s.start, s.token_ids] for i, (s, b)
                                                         in enumerate(zip(plan.seqs, before, strict=True))
                                                         if s.start != b]})
            return added
        msg = self.channel.recv()
        if msg.get("op") != "restart":
            raise RuntimeError(f"rank 0 sent {msg.get('op')!r} where the step's restart was due")
        added = 0
        for i, start, ids in msg["seqs"]:
            s = plan.seqs[i]
            added += s.start - start
            s.start_at(start, ids)
        return added
