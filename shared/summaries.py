"""Summaries the manager hands out, as records: each built once, read by name, one wire form.

- ``ServeInfo``: where a pool's rank-0 worker takes generate requests (``register``'s ``serve``
  field, PROTOCOL.md section 5): the worker announces it, the manager keeps and lists it.
- ``PoolSummary``: one pool at a glance (``register``'s reply and each ``pools`` row, before the
  admin details the ``pools`` op adds).
- ``WorkerRow``: one row of the ``workers`` op: a ready pool whose rank-0 worker serves, which a
  front door routes to (frontend/directory.py).

``to_wire`` gives the exact maps the daemon sent before these records existed (the same keys in
the same order, optional keys only when set); ``from_wire`` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.shared.protocol import check_serve


@dataclass(frozen=True)
class ServeInfo:
    endpoint: str  # ipc:// or tcp://
    model: str  # the id clients ask for
    max_model_len: int
    tokenizer: str | None = None  # where the tokenizer is, when ``model`` is not that path (a served name)

    def to_wire(self) -> dict:
        out = {"endpoint": self.endpoint, "model": self.model, "max_model_len": self.max_model_len}
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        return out

    @classmethod
    def from_wire(cls, v: Any) -> ServeInfo:
        """Validated (``bad_field`` ManagerError when it is not one)."""
        return cls(**check_serve(v))


@dataclass(frozen=True)
class PoolSummary:
    pool: str
    state: str  # "ready" or "pending"
    epoch: int
    registered: int  # shards registered
    shard_count: int
    num_blocks: int  # 0 while pending
    block_size: int
    host_num_blocks: int | None = None  # only for a ready pool with a host tier
    host_policy: str | None = None

    def to_wire(self) -> dict:
        out = {"pool": self.pool, "state": self.state, "epoch": self.epoch, "registered": self.registered,
               "shard_count": self.shard_count, "num_blocks": self.num_blocks, "block_size": self.block_size}
        if self.host_num_blocks is not None:  # a pool without a host tier: the keys of before
            out["host_num_blocks"] = self.host_num_blocks
            out["host_policy"] = self.host_policy
        return out

    @classmethod
    def from_wire(cls, d: dict) -> PoolSummary:
        return cls(d["pool"], d["state"], d["epoch"], d["registered"], d["shard_count"], d["num_blocks"],
                   d["block_size"], d.get("host_num_blocks"), d.get("host_policy"))


@dataclass(frozen=True)
class WorkerRow:
    serve: ServeInfo
    pool: str
    epoch: int
    num_blocks: int
    block_size: int
    free_blocks: int
    requests: int

    def to_wire(self) -> dict:
        return {**self.serve.to_wire(), "pool": self.pool, "epoch": self.epoch, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "free_blocks": self.free_blocks, "requests": self.requests}

    @classmethod
    def from_wire(cls, d: dict) -> WorkerRow:
        return cls(ServeInfo(d["endpoint"], d["model"], d["max_model_len"], d.get("tokenizer")), d["pool"], d["epoch"],
                   d["num_blocks"], d["block_size"], d["free_blocks"], d.get("requests", 0))
