"""Whether an attached server's KV events stopped while its HTTP still answers (pure, no clock).

vLLM stores a prompt's full blocks (and publishes their ``BlockStored`` batch) when it schedules
the prompt's computation, before the step that computes it; its /metrics counts the prompt's
computed tokens and the request once that step is done (manager/external/probe.py). So between
two polls of /metrics, if ``n`` requests got their prompt computed and together computed more
than ``n * (block_size - 1)`` prompt tokens, at least one of them computed a whole block, whose
batch the server published shortly before. (A cached prefix is always whole blocks, so a request
that computed ``block_size`` tokens or more filled a block of its own.) Fewer tokens prove
nothing: short prompts fill no block.

The rule: such evidence between the polls at ``t0`` and ``t1`` is matched by any batch received
after ``t0 - window_s``; when none has come by ``t1 + window_s``, the events stopped and the
mirror is marked stale. ``window_s`` covers a long prefill step (its batch goes out when it
starts) and the delivery of the batch. Counters that go back mean a new server process: the
baseline starts over (its events say the rest: a sequence starting over).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpool.manager.external.probe import ServerLoad


@dataclass
class SilenceWatch:
    block_size: int
    window_s: float
    last: ServerLoad | None = None
    # (earliest matching batch time, deadline, tokens computed) of evidence not yet matched
    pending: deque[tuple[float, float, int]] = field(default_factory=deque)

    def observe(self, load: ServerLoad, last_batch: float | None) -> str | None:
        """Takes one poll (``last_batch``: monotonic time of the server's latest batch, None
        before the first); returns why the mirror must be stale, or None."""
        prev, self.last = self.last, load
        if prev is not None:
            tokens = load.computed_tokens - prev.computed_tokens
            requests = load.prefilled - prev.prefilled
            if tokens < 0 or requests < 0:  # the counters went back: another process
                self.pending.clear()
            elif tokens > max(requests, 1) * (self.block_size - 1):
                self.pending.append((prev.at - self.window_s, load.at + self.window_s, int(tokens)))
        while self.pending and last_batch is not None and last_batch >= self.pending[0][0]:
            self.pending.popleft()
        if self.pending and load.at >= self.pending[0][1]:
            _, _, tokens = self.pending.popleft()
            self.pending.clear()
            return (f"its KV events stopped: it computed {tokens} prompt tokens (a whole block or more) and no "
                    f"event batch came within {self.window_s:g} s")
        return None
