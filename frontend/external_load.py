"""What the front door counts for an attached vLLM server (frontend/router.py's cost): the work it
sent there and has not seen finish, the server's own load beyond that (its /metrics, polled by
the manager: manager/external/probe.py), and the prefixes it routed there that the server's
events may not show yet (speculative entries).

- ``outstanding``: as for kvpool workers, the uncached prompt blocks (until its first token
  streams back) and ``max_tokens / block_size`` of every request this door has running there.
- ``foreign``: requests the server reported (running + waiting at its last poll) beyond those
  this door had running there at that moment (other clients, other doors), each counted as
  ``FOREIGN_BLOCKS`` blocks of work. The door's own are counted live, never from the poll, which
  lags a finished request by up to a poll interval.
- KV room: the server's device blocks in use now are estimated as the poll's
  (``kv_cache_usage_perc * num_gpu_blocks``) less what this door's requests held then, plus what
  hold now (the distinct prefix blocks of those running, and their own tails). A request that needs more
  new blocks than are free waits in vLLM's queue until running requests finish: the server's
  whole load counts twice for it.
- speculative entries: the hash chains of requests routed there count as blocks it will hold
  while they run and ``ROUTED_GRACE_S`` after (the server publishes a prompt's blocks when it
  schedules it, and the manager's mirror shows them within a poll): a burst of one tenant's
  requests, routed before the first is scheduled, goes where its prefix will be.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from kvpool.frontend.directory import External, Polled
from kvpool.frontend.router import Candidate

FOREIGN_BLOCKS = 2.0  # blocks of work one request of another client is taken for (unknown: a guess)
ROUTED_GRACE_S = 2.0  # a finished request's prefix counts as routed this long after it ended
POLL_FRESH_S = 5.0  # a /metrics answer older than this is not used
HISTORY_S = 10.0  # how far back the door remembers what it had running where


@dataclass
class Sent:
    """One request this door sent to an external server."""

    key: tuple[int, str]
    prefill: float  # blocks of work until its first token: its uncached prompt blocks
    decode: float  # then: max_tokens / block_size
    tail: float  # KV blocks of its own beyond its shared prefix (the last prompt block, its output)
    chain: list[bytes]  # its prompt's hash chain (its speculative entry)
    prefilled: bool = False
    released: bool = False


@dataclass
class _Account:
    outstanding: float = 0.0
    running: int = 0
    tails: float = 0.0
    held: Counter[bytes] = field(default_factory=Counter)  # chains of the requests running there
    routed: Counter[bytes] = field(default_factory=Counter)  # the same, and those in their grace
    history: deque[tuple[float, int, float]] = field(default_factory=deque)  # (t, running, kv) after each change

    def kv(self) -> float:
        return len(self.held) + self.tails

    def remember(self, now: float) -> None:
        self.history.append((now, self.running, self.kv()))
        while len(self.history) > 1 and self.history[1][0] < now - HISTORY_S:
            self.history.popleft()

    def at(self, t: float) -> tuple[int, float]:
        """(requests running, KV blocks held) by this door's requests at time ``t``: the most of
        either over a quarter second around it (the poll's moment is known to that much)."""
        running, kv = 0, 0.0
        for when, r, k in self.history:
            if when > t + 0.25:
                break
            if when <= t - 0.25:  # the state entering the window
                running, kv = r, k
            else:
                running, kv = max(running, r), max(kv, k)
        return running, kv


class ExternalLoad:
    def __init__(self) -> None:
        self.servers: dict[tuple[int, str], _Account] = {}

    def _of(self, key: tuple[int, str]) -> _Account:
        return self.servers.setdefault(key, _Account())

    def running(self, key: tuple[int, str]) -> int:
        return self._of(key).running

    def candidate(self, s: External, hit: int, host: int, chain: list[bytes], prompt_blocks: int,
                  tail: float, now: float | None = None) -> Candidate:
        now = time.monotonic() if now is None else now
        st = self._of(s.key)
        routed = leading(chain, st.routed)
        extra = self._extra(st, s.polled, prompt_blocks - routed + tail, now)
        return Candidate(s, hit, st.running, st.outstanding, routed, host_blocks=host, extra_load=extra)

    def _extra(self, st: _Account, polled: Polled | None, need: float, now: float) -> float:
        if polled is None or now - polled.at > POLL_FRESH_S:
            return 0.0
        own_running, own_kv = st.at(polled.at)
        extra = FOREIGN_BLOCKS * max(0, polled.running + polled.waiting - own_running)
        if polled.num_blocks:
            used = max(0.0, polled.kv_usage * polled.num_blocks - own_kv) + st.kv()
            if need > polled.num_blocks - used:  # no room: it waits for running requests to finish
                extra += st.outstanding + extra
        return extra

    def start(self, key: tuple[int, str], prefill: float, decode: float, tail: float, chain: list[bytes]) -> Sent:
        st = self._of(key)
        st.outstanding += prefill + decode
        st.running += 1
        st.tails += tail
        st.held.update(chain)
        st.routed.update(chain)
        st.remember(time.monotonic())
        return Sent(key, prefill, decode, tail, chain)

    def first_token(self, sent: Sent) -> None:
        """Its first token came back: its prompt is computed, only its decode is left."""
        if not sent.prefilled and not sent.released:
            sent.prefilled = True
            self._of(sent.key).outstanding -= sent.prefill

    def finish(self, sent: Sent) -> None:
        """The request ended: its work, tail and held blocks at once, its speculative entry after
        the grace."""
        if sent.released:
            return
        sent.released = True
        st = self._of(sent.key)
        st.outstanding -= sent.decode + (0.0 if sent.prefilled else sent.prefill)
        st.running -= 1
        st.tails -= sent.tail
        _drop(st.held, sent.chain)
        st.remember(time.monotonic())
        try:
            asyncio.get_running_loop().call_later(ROUTED_GRACE_S, self._forget, sent)
        except RuntimeError:  # no loop (a test): at once
            self._forget(sent)

    def _forget(self, sent: Sent) -> None:
        _drop(self._of(sent.key).routed, sent.chain)


def _drop(counts: Counter[bytes], chain: list[bytes]) -> None:
    counts.subtract(chain)
    for h in chain:
        if counts.get(h, 1) <= 0:
            del counts[h]


def leading(chain: list[bytes], held: Counter[bytes]) -> int:
    n = 0
    for h in chain:
        if not held.get(h):
            break
        n += 1
    return n
