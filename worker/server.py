"""The worker's generate service: a ZeroMQ ROUTER socket in front of one engine.

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
its requests are aborted and their blocks freed at once.

Flow control (PROTOCOL.md section 12): nothing to a connected client is dropped. What its pipe
does not take waits in its backlog, sent in order first thing each iteration; a client too far
behind (MAX_BACKLOG, BACKLOG_TIMEOUT_S) has its requests failed with an error message each. A
ping's answer lists the client's open requests, so a client can fail any the worker forgot.

The loop is single-threaded: drain the socket, run one engine step, send its tokens, heartbeat
the manager. While the manager refuses admissions (draining) the loop backs off, up to
``MAX_BACKOFF_S`` between steps, instead of resending at once. SIGTERM/SIGINT: abort every
request, free everything at the manager, deregister; a manager that does not answer is given
up after one try of each call (its sessions expire on their own), so shutdown is bounded.
On exit the ipc socket file is removed (worker/endpoint.py).
Optional: Prometheus metrics rendered by this loop (worker/metrics.py), and systemd's notify
protocol (READY=1 once bound, WATCHDOG=1 per iteration, STOPPING=1; a no-op outside systemd).
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque

import zmq

from kvpool.client.retry import Backoff, RetryPolicy
from kvpool.shared import generate as wire  # the messages' records (PROTOCOL.md section 12)
from kvpool.shared.curve import CurveServer
from kvpool.shared.notify import Notifier
from kvpool.shared.protocol import ManagerError
from kvpool.worker.endpoint import bound_inode, ipc_path, release
from kvpool.worker.engine import Engine, TokenEvent
from kvpool.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 100
# Messages read per iteration, before the engine steps: enough to empty what ZeroMQ's pipes and the
# kernel hold for a connection (about 5,000 small messages), so a message waits at most a step or
# two behind the flood its connection sent before it (with 256, a ping behind 20,000 generate
# messages waited 78 steps: 22 s at load 18); and a bound, so a flood cannot stop the stepping.
READ_BATCH = 4096
DROP_LOG_EVERY_S = 5.0
MAX_OPEN_REQUESTS = 4096  # client requests queued or running; more are refused until some finish
# Flow control: a message ZeroMQ will not take now (the client's pipe is full: it reads slower than
# we send) waits in that client's backlog, in order, and goes out as the client reads; nothing is
# dropped. A backlog above MAX_BACKLOG messages, or older than BACKLOG_TIMEOUT_S, fails that
# client's requests instead (aborted here, one error message each queued for it).
SNDHWM = 10_000
MAX_BACKLOG = 200_000
BACKLOG_TIMEOUT_S = 60.0
HEARTBEAT_S = 1.0  # an open request hears from the worker at least this often
MAX_BACKOFF_S = 1.0  # the longest pause between steps while the manager refuses admissions
STALL_BACKOFF = RetryPolicy(first_pause_s=0.05, max_pause_s=MAX_BACKOFF_S)  # no deadline: until admitted


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
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a client that is gone raises
        self._sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.curve = CurveServer(self._ctx, *curve) if curve else None
        if self.curve is not None:
            self.curve.apply(self._sock)
        self._clients: dict[str, tuple[bytes, str]] = {}  # engine id -> (routing id, client's id)
        self._open: dict[str, int] = {}  # engine id -> samples not finished yet
        self._last_sent: dict[str, float] = {}  # engine id -> when its client last heard from us
        self._next = 0
        self._stop = False
        self._backoff = Backoff(STALL_BACKOFF)  # the pause before the next step while the engine is stalled
        self._manager_down: str | None = None  # the last manager error, until a call succeeds
        self._inode: int | None = None
        self._next_file_check = 0.0
        self._reload = False  # SIGHUP: re-read the allowed CURVE keys at the next iteration
        self._backlog: dict[bytes, deque[bytes]] = {}  # client -> messages its pipe would not take yet
        self._backlog_since: dict[bytes, float] = {}
        self.replies_queued = 0  # messages that waited in a backlog (none is ever dropped)
        self.clients_failed = 0  # clients whose requests were failed for not reading
        self._next_drop_log = 0.0

    def request_stop(self, *_: object) -> None:
        self._stop = True
        self.engine.bm.stop_retrying()

    def request_reload(self, *_: object) -> None:
        self._reload = True

    def serve(self) -> None:
        self._sock.bind(self.endpoint)
        self._inode = bound_inode(self.endpoint)
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
        if self._backlog:
            self._flush_backlogs()
        busy = self.engine.has_work()
        wait_ms = IDLE_POLL_MS if not busy else int(self._backoff.current_s * 1000)
        if self._sock.poll(wait_ms, zmq.POLLIN):
            for _ in range(READ_BATCH):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames[0], frames[-1])
        if self.engine.has_work():
            self._step()
        now = time.monotonic()
        self._send_heartbeats(now)
        self._check_socket_file(now)
        self.notifier.tick()
        if self._reload:
            self._reload = False
            if self.curve is not None:
                self.curve.reload()
        if self.metrics is not None:
            self.metrics.maybe_update(self.engine)
        try:
            if self.engine.heartbeat():
                self._manager_down = None  # it answered: shutdown will free and deregister
        except ManagerError as e:
            self._manager_down = str(e)
            logger.warning("heartbeat failed: %s", e)

    def _step(self) -> None:
        try:
            t0 = time.perf_counter()
            events = self.engine.step()
            self._manager_down = None
            if self.metrics is not None:
                self.metrics.observe_step(time.perf_counter() - t0, sum(ev.token is not None for ev in events))
            self._send_events(events)
        except ManagerError as e:
            if e.code == "not_owner":  # another worker took the pool over (--replace): leave it
                logger.error("pool %s was taken over by another worker (%s): stopping", self.pool, e.message)
                self._stop = True
                return
            self._manager_down = str(e)  # unreachable while re-registering: retry shortly
            logger.warning("manager unavailable: %s", e)
            time.sleep(0.2)
        if self.engine.stalled is not None:
            self._backoff.advance()
        else:
            self._backoff.reset()

    def _check_socket_file(self, now: float) -> None:
        """Stops when another worker bound our ipc path (``kvpool worker --replace``): nobody
        can reach this one any more."""
        if self._inode is None or now < self._next_file_check:
            return
        self._next_file_check = now + HEARTBEAT_S
        current = bound_inode(self.endpoint)
        if current is not None and current != self._inode:
            logger.error("another worker took over %s: stopping", ipc_path(self.endpoint))
            self._stop = True

    def _waiting_reason(self) -> str | None:
        if self._manager_down is not None:
            return "manager_unreachable"
        return self.engine.stalled

    def _send_heartbeats(self, now: float) -> None:
        """Tells every client that heard nothing for HEARTBEAT_S that its request is alive (and
        why it waits); finds the clients that went away."""
        due = [eid for eid, at in self._last_sent.items() if now - at >= HEARTBEAT_S]
        reason = self._waiting_reason()
        for eid in due:
            if eid not in self._clients:
                continue  # aborted meanwhile (its client went away)
            ident, cid = self._clients[eid]
            self._last_sent[eid] = now
            self._reply(ident, wire.Heartbeat(cid, reason).to_wire())

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

    def _forget(self, eid: str) -> None:
        self._clients.pop(eid, None)
        self._open.pop(eid, None)
        self._last_sent.pop(eid, None)

    def _reply(self, ident: bytes, body: dict) -> bool:
        """Sends one message, or queues it behind what the client has not read yet; False when the
        client is gone (its requests are then aborted)."""
        payload = wire.pack(body)
        queue = self._backlog.get(ident)
        if queue is not None:
            self._queue(ident, queue, payload)
            return True
        try:
            self._sock.send_multipart([ident, payload], zmq.NOBLOCK)
        except zmq.Again:
            self._backlog[ident] = deque()
            self._backlog_since[ident] = time.monotonic()
            self._queue(ident, self._backlog[ident], payload)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._client_gone(ident)
            return False
        return True

    def _queue(self, ident: bytes, queue: deque[bytes], payload: bytes) -> None:
        queue.append(payload)
        self.replies_queued += 1
        now = time.monotonic()
        if now >= self._next_drop_log:  # a slow client must not flood the log
            self._next_drop_log = now + DROP_LOG_EVERY_S
            logger.warning("client %r reads slower than the worker sends: %d messages wait for it", ident, len(queue))
        if len(queue) > MAX_BACKLOG:
            self._fail_client(ident, f"it left more than {MAX_BACKLOG} messages unread")

    def _flush_backlogs(self) -> None:
        """Sends what each backlog's client takes now (in order); fails a client stuck too long."""
        now = time.monotonic()
        for ident in list(self._backlog):
            queue = self._backlog[ident]
            try:
                while queue:
                    self._sock.send_multipart([ident, queue[0]], zmq.NOBLOCK)
                    queue.popleft()
            except zmq.Again:
                if now - self._backlog_since[ident] > BACKLOG_TIMEOUT_S:
                    self._fail_client(ident, f"it read nothing for {BACKLOG_TIMEOUT_S:.0f} s")
                continue
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self._drop_backlog(ident)
                self._client_gone(ident)
                continue
            self._drop_backlog(ident)

    def _drop_backlog(self, ident: bytes) -> None:
        self._backlog.pop(ident, None)
        self._backlog_since.pop(ident, None)

    def _fail_client(self, ident: bytes, why: str) -> None:
        """The client does not read: its requests are aborted (their blocks freed) and its backlog
        replaced by one error message per request, which it gets if it ever reads again."""
        self.clients_failed += 1
        mine = [(eid, cid) for eid, (owner, cid) in self._clients.items() if owner == ident]
        logger.warning("client %r: %s; failing its %d requests", ident, why, len(mine))
        queue = self._backlog.setdefault(ident, deque())
        queue.clear()
        self._backlog_since[ident] = time.monotonic()
        for eid, cid in mine:
            self._forget(eid)
            self.engine.abort(eid)
            queue.append(wire.pack(wire.ErrorMessage(cid, f"the worker failed this request: the client {why}").to_wire()))

    def _client_gone(self, ident: bytes) -> None:
        """The client's connection is closed: nobody will read its requests' tokens."""
        gone = [eid for eid, (owner, _) in self._clients.items() if owner == ident]
        for eid in gone:
            self._forget(eid)
            self.engine.abort(eid)  # its final events have nobody to go to
        if gone:
            logger.info("a client went away: aborted its %d request(s), their blocks are freed", len(gone))

    def shutdown(self) -> None:
        self.notifier.stopping()
        if self.metrics is not None:
            self.metrics.close()
        self.engine.bm.stop_retrying()
        for eid in list(self._clients):
            try:
                self._send_events(self.engine.abort(eid))
            except Exception:  # one bad request must not keep the worker from deregistering
                logger.exception("aborting request %s on shutdown failed", eid)
        try:
            self.engine.shutdown(reach_manager=self._manager_down is None)  # known down: do not wait again
        except ManagerError as e:
            logger.warning("shutdown: the manager did not answer (%s); gave up freeing this worker's requests "
                           "and deregistering: the manager frees them when the session times out", e)
        self.engine.bm.close()
        self._sock.close(linger=200)
        if self.curve is not None:
            self.curve.close()
        self._ctx.term()
        release(self.endpoint, self._inode)
        logger.info("worker for pool %s stopped", self.pool)
