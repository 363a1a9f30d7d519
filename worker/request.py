"""The one mutable record of a request (one sample of a client request) inside the worker."""

from __future__ import annotations

from kvpool.shared.hashing import BlockHasher
from kvpool.worker.sampler import SamplingParams


class Request:
    """Tokens, KV progress and block table of one sequence.

    ``tokens[:num_computed]`` have their K/V in the cache; the rest (the prompt tail, the last
    sampled token) are computed by later steps. ``rid`` is the manager's request id.

    What the scheduler has asked for but not yet seen answered (a step in flight): ``num_scheduled``
    tokens, ``num_pending_samples`` tokens still to be sampled, ``admitting`` (an alloc). The
    manager's view: ``synced_tokens`` (its num_tokens), ``num_slots`` (slots of the blocks it gave),
    ``num_hashes_sent``. ``generation`` moves on whenever the request leaves the running set or
    loses its KV, so that plan entries made before no longer count.
    """

    __slots__ = ("rid", "client_id", "index", "tokens", "num_prompt", "num_computed", "block_table",
                 "hasher", "num_hashes_sent", "params", "seed", "finish_reason", "forked",
                 "num_preemptions", "generation", "num_scheduled", "num_pending_samples", "admitting",
                 "synced_tokens", "num_slots", "must_sync", "in_running")

    def __init__(self, rid: int, client_id: str, index: int, tokens: list[int], num_prompt: int,
                 params: SamplingParams, seed: int, block_size: int, cache_salt: str | None = None) -> None:
        self.rid = rid
        self.client_id = client_id
        self.index = index  # which of the client request's n samples
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.num_computed = 0
        self.block_table: list[int] = []
        self.hasher = BlockHasher(block_size, cache_salt=cache_salt)  # a salt keeps tenants apart
        self.hasher.append(tokens)
        self.num_hashes_sent = 0  # hashes the manager knows for this request
        self.params = params
        self.seed = seed
        self.finish_reason: str | None = None
        self.forked = params.n == 1  # n > 1: children are spawned at the first sample
        self.num_preemptions = 0
        self.generation = 0
        self.num_scheduled = 0
        self.num_pending_samples = 0
        self.admitting = False
        self.synced_tokens = 0
        self.num_slots = 0
        self.must_sync = False  # forked: the next write must reach the manager (copy-on-write)
        self.in_running = False  # in the scheduler's running set (worker/running_set.py counts its blocks)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_remaining(self) -> int:
        """Tokens known (or being sampled) but not yet computed or scheduled."""
        return len(self.tokens) + self.num_pending_samples - self.num_computed - self.num_scheduled

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.hasher.append((token,))

    def reset_kv(self) -> None:
        """Forget KV progress (preemption by recompute, or the manager lost the request)."""
        self.num_computed = 0
        self.block_table = []
        self.num_hashes_sent = 0
        self.num_scheduled = self.num_pending_samples = self.synced_tokens = self.num_slots = 0
        self.admitting = self.must_sync = False
        self.generation += 1

    def __repr__(self) -> str:
        return (f"Request(rid={self.rid}, client={self.client_id!r}#{self.index}, "
                f"tokens={len(self.tokens)}, computed={self.num_computed})")
