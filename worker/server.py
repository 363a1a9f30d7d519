"""The worker's generate service: a ZeroMQ ROUTER socket in front of one engine.

Messages are msgpack maps (never pickle). Client -> worker::

    {"op": "generate", "id": str, "prompt": [int...], "cache_salt": str (optional),
     "params": {max_tokens, temperature, top_p, seed, n, ignore_eos, top_k, min_tokens,
     presence_penalty, frequency_penalty, stop_token_ids, logprobs}}
                                                            -> a stream of token messages
    {"op": "abort", "id": str}                              -> the request's final messages
    {"op": "stats", "id": str}                              -> {"id", "stats": {...}}
    {"op": "ping", "id": str}                               -> {"id", "pong": pool name}

Worker -> client, one per sampled token (``index``: which of the n samples)::

    {"id": str, "index": int, "token": int | None, "finished": bool, "reason": str | None}
    (+ "logprob": float, "top_logprobs": [[token, logprob]...] when params.logprobs is set)
    {"id": str, "error": str, "finished": true}             (refused request or bad message)

The loop is single-threaded: drain the socket, run one engine step, send its tokens, heartbeat
the manager. SIGTERM/SIGINT: abort every request, free everything at the manager, deregister.
Optional: Prometheus metrics rendered by this loop (worker/metrics.py), and systemd's notify
protocol (READY=1 once bound, WATCHDOG=1 per iteration, STOPPING=1; a no-op outside systemd).
"""

from __future__ import annotations

import logging
import signal
import time

import msgpack
import zmq

from kvpool.shared.curve import CurveServer
from kvpool.shared.notify import Notifier
from kvpool.shared.protocol import ManagerError
from kvpool.worker.engine import Engine, TokenEvent
from kvpool.worker.metrics import WorkerMetrics
from kvpool.worker.wire import MAX_MESSAGE_BYTES, client_id, decode, op_of, parse_generate

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 100
MAX_BATCH = 256  # messages read per iteration: a flood cannot stop the engine from stepping
DROP_LOG_EVERY_S = 5.0
MAX_OPEN_REQUESTS = 4096  # client requests queued or running; more are refused until some finish


def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class WorkerServer:
    def __init__(self, engine: Engine, endpoint: str, pool: str, *, metrics: WorkerMetrics | None = None,
                 curve: tuple[str, str] | None = None) -> None:
        """``curve``: (this worker's NAME.key_secret, the allowed clients' key directory)."""
        self.engine = engine
        self.metrics = metrics
        self.notifier = Notifier()
        self.endpoint = endpoint
        self.pool = pool
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.curve = CurveServer(self._ctx, *curve) if curve else None
        if self.curve is not None:
            self.curve.apply(self._sock)
        self._clients: dict[str, tuple[bytes, str]] = {}  # engine id -> (routing id, client's id)
        self._open: dict[str, int] = {}  # engine id -> samples not finished yet
        self._next = 0
        self._stop = False
        self._reload = False  # SIGHUP: re-read the allowed CURVE keys at the next iteration
        self.replies_dropped = 0  # replies to clients that do not read (their queue was full)
        self._next_drop_log = 0.0

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def request_reload(self, *_: object) -> None:
        self._reload = True

    def serve(self) -> None:
        self._sock.bind(self.endpoint)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        logger.info("worker for pool %s serving at %s", self.pool, self.endpoint)
        self.notifier.ready(f"pool {self.pool}: serving at {self.endpoint}")
        try:
            while not self._stop:
                self.run_once()
        finally:
            self.shutdown()

    def run_once(self) -> None:
        busy = self.engine.has_work()
        if self._sock.poll(0 if busy else IDLE_POLL_MS, zmq.POLLIN):
            for _ in range(MAX_BATCH):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames[0], frames[-1])
        if self.engine.has_work():
            try:
                t0 = time.perf_counter()
                events = self.engine.step()
                if self.metrics is not None:
                    self.metrics.observe_step(time.perf_counter() - t0, sum(ev.token is not None for ev in events))
                self._send_events(events)
            except ManagerError as e:  # unreachable while re-registering: retry shortly
                logger.warning("manager unavailable: %s", e)
                time.sleep(0.2)
        self.notifier.tick()
        if self._reload:
            self._reload = False
            if self.curve is not None:
                self.curve.reload()
        if self.metrics is not None:
            self.metrics.maybe_update(self.engine)
        try:
            self.engine.heartbeat()
        except ManagerError as e:
            logger.warning("heartbeat failed: %s", e)

    def _handle(self, ident: bytes, payload: bytes) -> None:
        """One message; anything wrong with it becomes an error reply (never an exception)."""
        cid = ""
        try:
            msg = decode(payload)
            op = op_of(msg)
            cid = client_id(msg)
            if op == "generate":
                self._generate(ident, msg)
            elif op == "abort":
                self._abort(ident, cid)
            elif op == "stats":
                self._reply(ident, {"id": cid, "stats": {"pool": self.pool, **self.engine.stats()}})
            else:
                self._reply(ident, {"id": cid, "pong": self.pool})
        except ValueError as e:
            self._reply(ident, {"id": cid, "error": str(e), "finished": True})
        except Exception:  # a bug, not the client's fault: it must not stop the worker either
            logger.exception("internal error handling a generate-socket message")
            self._reply(ident, {"id": cid, "error": "internal worker error (logged)", "finished": True})

    def _generate(self, ident: bytes, msg: dict) -> None:
        req = parse_generate(msg)
        if len(self._clients) >= MAX_OPEN_REQUESTS:
            raise ValueError(f"the worker has {MAX_OPEN_REQUESTS} open requests; retry when some finished")
        eid = f"c{self._next}"
        self._next += 1
        self.engine.add_request(req.prompt, req.params, request_id=eid, cache_salt=req.cache_salt)
        self._clients[eid] = (ident, req.client_id)
        self._open[eid] = req.params.n

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
            body = {"id": cid, "index": ev.index, "token": ev.token, "finished": ev.finished,
                    "reason": ev.finish_reason}
            if ev.logprob is not None:
                body.update(logprob=ev.logprob, top_logprobs=ev.top_logprobs)
            self._reply(ident, body)
            if ev.finished:
                self._open[ev.request_id] -= 1
                if self._open[ev.request_id] == 0:
                    del self._clients[ev.request_id], self._open[ev.request_id]

    def _reply(self, ident: bytes, body: dict) -> None:
        try:
            self._sock.send_multipart([ident, pack(body)], zmq.NOBLOCK)
        except zmq.Again:
            self.replies_dropped += 1
            now = time.monotonic()
            if now >= self._next_drop_log:  # a flooding client must not flood the log too
                self._next_drop_log = now + DROP_LOG_EVERY_S
                logger.warning("client %r is not reading; %d replies dropped so far", ident, self.replies_dropped)

    def shutdown(self) -> None:
        self.notifier.stopping()
        if self.metrics is not None:
            self.metrics.close()
        for eid in list(self._clients):
            try:
                self._send_events(self.engine.abort(eid))
            except Exception:  # one bad request must not keep the worker from deregistering
                logger.exception("aborting request %s on shutdown failed", eid)
        try:
            self.engine.shutdown()
        except ManagerError as e:
            logger.warning("could not free at the manager on shutdown: %s", e)
        self.engine.bm.close()
        self._sock.close(linger=200)
        if self.curve is not None:
            self.curve.close()
        self._ctx.term()
        logger.info("worker for pool %s stopped", self.pool)
