"""One sequence (one sample of a client request) inside the worker, in three records:

- ``Request``: the sequence itself: ``rid`` (the manager's request id), ``request_id`` and
  ``index`` (the client request and which of its n samples), tokens, sampling params and seed,
  the block hasher, how it ended (``finish_reason``). Its changes are its own methods: a sampled
  token (``append``), the end (``finish``), the split of its n samples (``split``, ``new_sample``).
- ``req.kv``: the manager's view of its blocks (worker/kv_view.py ``KVView``: block table,
  synced tokens, hashes sent, slots).
- ``req.step``: the scheduler's record of its progress and of what is in flight
  (worker/step_state.py ``StepState``).

``tokens[:step.num_computed]`` have their K/V in the cache; the rest (the prompt tail, the last
sampled token) are computed by later steps.
"""

from __future__ import annotations

from kvpool.shared.hashing import BlockHasher
from kvpool.worker.kv_view import KVView
from kvpool.worker.sampler import SamplingParams
from kvpool.worker.step_state import StepState


class Request:
    __slots__ = ("rid", "request_id", "index", "tokens", "num_prompt", "params", "seed", "hasher",
                 "finish_reason", "holds_all_samples", "kv", "step")

    def __init__(self, rid: int, request_id: str, index: int, tokens: list[int], num_prompt: int,
                 params: SamplingParams, seed: int, block_size: int, cache_salt: str | None = None) -> None:
        self.rid = rid
        self.request_id = request_id  # the client request's id (one per request, whatever its n)
        self.index = index  # which of the client request's n samples
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.params = params
        self.seed = seed
        self.hasher = BlockHasher(block_size, cache_salt=cache_salt)  # a salt keeps tenants apart
        self.hasher.append(tokens)
        self.finish_reason: str | None = None
        # n > 1: one request computes the prompt and stands for all n samples until the first
        # is drawn; then each of the others becomes a request of its own (``new_sample``)
        self.holds_all_samples = params.n > 1
        self.kv = KVView()
        self.step = StepState()

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_computed(self) -> int:
        return self.step.num_computed

    @property
    def block_table(self) -> list[int]:
        return self.kv.block_table

    @property
    def num_remaining(self) -> int:
        """Tokens known (or being sampled) but not yet computed or scheduled."""
        st = self.step
        return len(self.tokens) + st.num_pending_samples - st.num_computed - st.num_scheduled

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.hasher.append((token,))

    def finish(self, reason: str) -> None:
        """It ended: "stop", "length", "abort" or "error: ..."."""
        self.finish_reason = reason

    def split(self) -> None:
        """Its first sample is drawn: from now on it is sample ``index`` alone."""
        self.holds_all_samples = False

    def new_sample(self, index: int, rid: int) -> Request:
        """Sample ``index`` of this request's n as a request of its own (manager id ``rid``):
        the prompt, params, seed and cache salt; it shares this one's computed blocks once the
        scheduler forks it."""
        child = Request(rid, self.request_id, index, self.tokens[: self.num_prompt], self.num_prompt,
                        self.params, self.seed, self.hasher.block_size, self.hasher.cache_salt)
        child.holds_all_samples = False
        return child

    def __repr__(self) -> str:
        return (f"Request(rid={self.rid}, request={self.request_id!r}#{self.index}, "
                f"tokens={len(self.tokens)}, computed={self.step.num_computed})")
