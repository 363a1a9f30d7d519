"""The generate socket's messages: what each one asks of the engine, and the requests clients opened.

Messages are msgpack maps (never pickle), each a record of shared/generate.py (PROTOCOL.md
section 12; the clients are kvpool.client's). Client -> worker::

    {"op": "generate", "id": str, "prompt": [int...], "cache_salt": str (optional),
     "params": {max_tokens, temperature, top_p, seed, n, ignore_eos, top_k, min_tokens,
     presence_penalty, frequency_penalty, repetition_penalty, min_p, stop_token_ids, logprobs}}
                                                            -> a stream of token messages
    {"op": "abort", "id": str}                              -> the request's final messages
    {"op": "stats", "id": str}                              -> {"id", "stats": {...}}
    {"op": "ping", "id": str}                               -> {"id", "pong": pool name}

Worker -> client, one per sampled token (``index``: which of the n samples)::

    {"id": str, "index": int, "token": int | None, "finished": bool, "reason": str | None}
    (+ "logprob": float, "top_logprobs": [[token, logprob]...] when params.logprobs is set)
    {"id": str, "error": str, "finished": true}             (refused request or bad message)
    {"id": str, "heartbeat": true, "finished": false, "waiting": str | None}

A heartbeat goes to every open request that got no message for ``HEARTBEAT_S``: the client
knows the worker is alive, and ``waiting`` says why nothing moves ("draining": the manager
refuses new allocations; "manager_unreachable"; None: queued or computing). Sending is also how
the worker notices a client that went away (ZeroMQ's ROUTER_MANDATORY: its connection is gone):
its requests are aborted and their blocks freed at once. A ping's answer lists the client's open
requests, so a client can fail any the worker forgot.

``GenerateHandler`` owns the open requests: each one's engine id (``cN``: client ids collide
across clients), its client, its samples not finished and when its client last heard from the
worker. Its one subclass, the server (worker/server.py), owns the socket and sends (``_reply``).
"""

from __future__ import annotations

import logging
import time

from kvpool.shared import generate as wire  # the messages' records (PROTOCOL.md section 12)
from kvpool.worker.engine import Engine
from kvpool.worker.live_requests import TokenEvent

logger = logging.getLogger(__name__)
MAX_OPEN_REQUESTS = 4096  # client requests queued or running; more are refused until some finish
HEARTBEAT_S = 1.0  # an open request hears from the worker at least this often


class GenerateHandler:
    def __init__(self, engine: Engine, pool: str) -> None:
        self.engine = engine
        self.pool = pool
        self._clients: dict[str, tuple[bytes, str]] = {}  # engine id -> (routing id, client's id)
        self._open: dict[str, int] = {}  # engine id -> samples not finished yet
        self._last_sent: dict[str, float] = {}  # engine id -> when its client last heard from us
        self._next = 0

    def _reply(self, ident: bytes, body: dict) -> bool:
        """Sends one message; False when the client is gone (its requests are then aborted)."""
        raise NotImplementedError

    def _handle(self, ident: bytes, payload: bytes) -> None:
        """One message; anything wrong with it becomes an error reply (never an exception)."""
        cid = ""
        try:
            msg = wire.decode(payload)
            op = wire.op_of(msg)
            cid = wire.client_id(msg)
            if op == "generate":
                self._generate(ident, msg)
            elif op == "abort":
                self._abort(ident, cid)
            elif op == "stats":
                self._reply(ident, wire.StatsReply(cid, {"pool": self.pool, **self.engine.stats()}).to_wire())
            else:  # ping: with the ids of this client's open requests, which it reconciles with its own
                opened = tuple(c for owner, c in self._clients.values() if owner == ident)
                self._reply(ident, wire.Pong(cid, self.pool, opened).to_wire())
        except ValueError as e:
            self._reply(ident, wire.ErrorMessage(cid, str(e)).to_wire())
        except Exception:  # a bug, not the client's fault: it must not stop the worker either
            logger.exception("internal error handling a generate-socket message")
            self._reply(ident, wire.ErrorMessage(cid, "internal worker error (logged)").to_wire())

    def _generate(self, ident: bytes, msg: dict) -> None:
        if len(self._clients) >= MAX_OPEN_REQUESTS:  # before decoding: a flood's excess is refused cheaply
            raise ValueError(f"the worker has {MAX_OPEN_REQUESTS} open requests; retry when some finished")
        req = wire.GenerateRequest.from_wire(msg)
        eid = f"c{self._next}"
        self._next += 1
        self.engine.add_request(req.prompt, req.params, request_id=eid, cache_salt=req.cache_salt)
        self._clients[eid] = (ident, req.client_id)
        self._open[eid] = req.params.n
        self._last_sent[eid] = time.monotonic()

    def _abort(self, ident: bytes, cid: str) -> None:
        # ids are the client's own (every GenerateClient starts at "generate-0"): match the sender too
        for eid, owner in list(self._clients.items()):
            if owner == (ident, cid):
                self._send_events(self.engine.abort(eid))

    def _send_events(self, events: list[TokenEvent]) -> None:
        for ev in events:
            ident, cid = self._clients.get(ev.request_id, (None, ""))
            if ident is None:
                continue
            body = wire.TokenMessage(cid, ev.index, ev.token, ev.finished, ev.finish_reason, ev.logprob,
                                ev.top_logprobs).to_wire()
            self._last_sent[ev.request_id] = time.monotonic()
            self._reply(ident, body)
            if ev.finished and ev.request_id in self._open:
                self._open[ev.request_id] -= 1
                if self._open[ev.request_id] == 0:
                    self._forget(ev.request_id)

    def _send_heartbeats(self, now: float, reason: str | None) -> None:
        """Tells every client that heard nothing for HEARTBEAT_S that its request is alive (and
        why it waits: ``reason``); finds the clients that went away."""
        due = [eid for eid, at in self._last_sent.items() if now - at >= HEARTBEAT_S]
        for eid in due:
            if eid not in self._clients:
                continue  # aborted meanwhile (its client went away)
            ident, cid = self._clients[eid]
            self._last_sent[eid] = now
            self._reply(ident, wire.Heartbeat(cid, reason).to_wire())

    def _forget(self, eid: str) -> None:
        self._clients.pop(eid, None)
        self._open.pop(eid, None)
        self._last_sent.pop(eid, None)

    def _fail_client(self, ident: bytes, why: str) -> list[bytes]:
        """The client does not read: its requests are aborted (their blocks freed); returns one
        error message per request, which replace its backlog (worker/outbox.py)."""
        mine = [(eid, cid) for eid, (owner, cid) in self._clients.items() if owner == ident]
        logger.warning("client %r: %s; failing its %d requests", ident, why, len(mine))
        errors = []
        for eid, cid in mine:
            self._forget(eid)
            self.engine.abort(eid)
            errors.append(wire.pack(wire.ErrorMessage(cid, f"the worker failed this request: the client {why}").to_wire()))
        return errors

    def _client_gone(self, ident: bytes) -> None:
        """The client's connection is closed: nobody will read its requests' tokens."""
        gone = [eid for eid, (owner, _) in self._clients.items() if owner == ident]
        for eid in gone:
            self._forget(eid)
            self.engine.abort(eid)  # its final events have nobody to go to
        if gone:
            logger.info("a client went away: aborted its %d request(s), their blocks are freed", len(gone))

    def _abort_all(self) -> None:
        """Shutdown: every open request ends, its client told (as far as it reads)."""
        for eid in list(self._clients):
            try:
                self._send_events(self.engine.abort(eid))
            except Exception:  # one bad request must not keep the worker from deregistering
                logger.exception("aborting request %s on shutdown failed", eid)
