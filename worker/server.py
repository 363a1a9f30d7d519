"""The worker's generate service: a ZeroMQ ROUTER socket in front of one engine.

What the messages mean, and the requests clients open with them, is worker/generate_handler.py's
(``GenerateHandler``, which this class extends); flow control, under which nothing to a
connected client is dropped, is worker/outbox.py's (PROTOCOL.md section 12 for both).

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

import zmq

from kvpool.client.retry import Backoff, RetryPolicy
from kvpool.shared import generate as wire  # the messages' records (PROTOCOL.md section 12)
from kvpool.shared.curve import CurveServer
from kvpool.shared.notify import Notifier
from kvpool.shared.protocol import ManagerError
from kvpool.worker.endpoint import bound_inode, ipc_path, release
from kvpool.worker.engine import Engine
from kvpool.worker.generate_handler import HEARTBEAT_S, GenerateHandler
from kvpool.worker.metrics import WorkerMetrics
from kvpool.worker.outbox import Outbox

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 100
# Messages read per iteration, before the engine steps: enough to empty what ZeroMQ's pipes and the
# kernel hold for a connection (about 5,000 small messages), so a message waits at most a step or
# two behind the flood its connection sent before it (with 256, a ping behind 20,000 generate
# messages waited 78 steps: 22 s at load 18); and a bound, so a flood cannot stop the stepping.
READ_BATCH = 4096
SNDHWM = 10_000  # a client's pipe; what it does not take waits in the outbox's backlog for it
MAX_BACKOFF_S = 1.0  # the longest pause between steps while the manager refuses admissions
STALL_BACKOFF = RetryPolicy(first_pause_s=0.05, max_pause_s=MAX_BACKOFF_S)  # no deadline: until admitted


class WorkerServer(GenerateHandler):
    def __init__(self, engine: Engine, endpoint: str, pool: str, *, metrics: WorkerMetrics | None = None,
                 curve: tuple[str, str] | None = None) -> None:
        """``curve``: (this worker's NAME.key_secret, the allowed clients' key directory)."""
        super().__init__(engine, pool)
        self.metrics = metrics
        self.notifier = Notifier()
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a client that is gone raises
        self._sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.curve = CurveServer(self._ctx, *curve) if curve else None
        if self.curve is not None:
            self.curve.apply(self._sock)
        self._stop = False
        self._backoff = Backoff(STALL_BACKOFF)  # the pause before the next step while the engine is stalled
        self._manager_down: str | None = None  # the last manager error, until a call succeeds
        self._inode: int | None = None
        self._next_file_check = 0.0
        self._reload = False  # SIGHUP: re-read the allowed CURVE keys at the next iteration
        self.outbox = Outbox(self._sock, self._fail_client, self._client_gone)

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
        if self.outbox.backlogged():
            self.outbox.flush()
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
        self._send_heartbeats(now, self._waiting_reason())
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

    def _reply(self, ident: bytes, body: dict) -> bool:
        """Sends one message (worker/outbox.py: or queues it behind what the client has not read
        yet); False when the client is gone (its requests are then aborted)."""
        return self.outbox.send(ident, wire.pack(body))

    def shutdown(self) -> None:
        self.notifier.stopping()
        if self.metrics is not None:
            self.metrics.close()
        self.engine.bm.stop_retrying()
        self._abort_all()
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
