"""The engine's requests as its callers know them, and the ``TokenEvent`` each step gives out.

A request id (the caller's, or ``req-N``) names one request and all of its n samples: each sample
is a ``Request`` of its own once the scheduler spawned it (worker/request.py). ``LiveRequests``
maps the id to the samples that have not ended; an id leaves it with its last sample, so an
id is free again once its request is over.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.worker.request import Request
from kvpool.worker.step_plan import Output, Updated


@dataclass
class TokenEvent:
    request_id: str
    index: int  # which of the request's n samples
    token: int | None  # None: the request ended without a token (error, abort)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, a stop id), "length", "abort", "error: ..."
    logprob: float | None = None  # of the token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None


def end_events(req: Request, reason: str) -> list[TokenEvent]:
    """Final events of a request ended without a token (its unspawned samples included)."""
    indices = range(req.params.n) if req.holds_all_samples else [req.index]
    return [TokenEvent(req.request_id, i, None, True, reason) for i in indices]


class LiveRequests(dict[str, list[Request]]):
    """request id -> its samples that have not ended (the first sample holds all n until its first
    token; the ones spawned then join it)."""

    def forget(self, req: Request) -> None:
        reqs = self.get(req.request_id, [])
        if req in reqs:
            reqs.remove(req)
        if not reqs:
            self.pop(req.request_id, None)

    def end_with_error(self, errored: list[Request]) -> list[TokenEvent]:
        for req in errored:
            self.forget(req)
        return [ev for r in errored for ev in end_events(r, r.finish_reason or "error")]

    def token_events(self, outputs: list[Output], done: Updated) -> list[TokenEvent]:
        """Events of the tokens ``outputs`` drew, as the scheduler's update gave them out."""
        events = []
        for out, req in zip(outputs, done.receivers(outputs)):
            if out.sample:  # a parallel sample the scheduler spawned (the parent may have ended)
                self.setdefault(req.request_id, []).append(req)
            if req.finish_reason == "abort":
                continue  # aborted while its step ran: its final event was sent by abort
            if req.finish_reason is not None:
                self.forget(req)
            events.append(TokenEvent(req.request_id, req.index, out.token, req.finish_reason is not None,
                                     req.finish_reason, out.logprob, out.top_logprobs))
        return events
