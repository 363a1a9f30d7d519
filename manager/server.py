"""The manager daemon: one single-threaded loop over a ROUTER socket owns every pool.

Each iteration: wait for a message (or the next expiry check; after a busy iteration the wait
first spins a bounded, adaptive window: manager/busy_poll.py), read and handle the ready
messages in arrival order (up to ``max_batch``, or until they took ``max_batch_ms``: ZeroMQ
takes the clients in turn, so a flood gets its share and the others theirs), expire silent sessions, commit the iteration's
mutations to the store, hand the pools' KV events to the publisher, then send the replies.
Without persistence and KV events there is nothing to commit or publish first, and each reply
leaves as soon as its message is handled.
Nothing a client sends can kill the loop: bad input becomes an error reply (or, with a
malformed envelope, a counted drop) and changes nothing. Framing: shared/protocol.py.

The loop's parts, each in its own module: the socket (manager/router_socket.py), one message
(manager/dispatch.py), the commit and what it decides about the replies (manager/group_commit.py),
the timed chores: expiry and idle collections (manager/timers.py). CURVE, KV-event sockets,
metrics and systemd notify hang off the loop in manager/loop_hooks.py.
"""

from __future__ import annotations

import logging
import time
import uuid

import zmq

from kvpool.manager.busy_poll import BusyPoll
from kvpool.manager.check_job import CheckJobs
from kvpool.manager.config import ManagerConfig
from kvpool.manager.dispatch import Dispatcher
from kvpool.manager.group_commit import GroupCommit
from kvpool.manager.guards import Bounds
from kvpool.manager.handlers import Handlers
from kvpool.manager.loop_hooks import LoopHooks
from kvpool.manager.node_tiers import NodeTiers
from kvpool.manager.ops import OPS, Answer
from kvpool.manager.registry import Registry
from kvpool.manager.router_socket import RouterSocket
from kvpool.manager.stats import ServerStats
from kvpool.manager.store.base import EventSink, NullSink, StateStore
from kvpool.manager.store.recovery import Recovery, settle_heap
from kvpool.manager.store_config import open_store
from kvpool.manager.timers import LoopTimers
from kvpool.shared.protocol import max_containers

logger = logging.getLogger(__name__)

__all__ = ["OPS", "Server"]  # OPS: the dispatch table (manager/ops.py)
MAX_POLL_MS = 100  # the loop wakes at least this often (expiry checks, stop requests)
# Plain ints: pyzmq's enum members cost more to look up and combine than the call they flag.
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


class Server:
    """The daemon: builds the loop's parts from the config, binds, serves, closes."""

    def __init__(
        self,
        cfg: ManagerConfig,
        *,
        store: StateStore | None = None,
        publisher: EventSink | None = None,
        incarnation: str | None = None,
    ) -> None:
        self.cfg = cfg
        # KV events are built only when something can receive them (an events socket, a given sink)
        self._kv_events = bool(cfg.events_endpoint) or not isinstance(publisher or NullSink(), NullSink)
        self.registry = self.new_registry(incarnation or uuid.uuid4().hex)
        self.busy_poll = BusyPoll(cfg.busy_poll_us / 1e6)
        self.stats = ServerStats(busy_poll=self.busy_poll)
        self.store: StateStore = store or open_store(cfg)
        self.recovery = Recovery(self.store, self.registry, lease_ms=cfg.lease_ms, new_registry=self.new_registry,
                                 errors=self.stats.errors, request_stop=self.request_stop)
        self.handlers = Handlers(
            self.registry, self.stats, max_sub_ops=cfg.max_sub_ops, max_message_bytes=cfg.max_message_bytes,
            admin_key=cfg.admin_key, request_stop=self.request_stop,
            bounds=Bounds(cfg.max_step_blocks, cfg.max_session_blocks, cfg.max_total_blocks, cfg.max_model_len),
            store_stats=self.store.stats,
            events_info={"events_endpoint": cfg.events_endpoint, "events_replay_endpoint": cfg.events_replay_endpoint},
            admin_needs_key=bool(cfg.curve_secret_key_file),  # CURVE keys are not admin keys
        )
        self.handlers.configure_external(cfg.vllm_metrics_poll_s, cfg.vllm_events_window_s)
        self.checks = CheckJobs(self.registry, self.stats.errors)  # `check` of a large state: a forked child
        self.dispatcher = Dispatcher(self.registry, self.handlers, self.stats, self.recovery, self.checks,
                                     max_message_bytes=cfg.max_message_bytes,
                                     max_objects=max_containers(cfg.max_sub_ops),  # maps + arrays per message
                                     admin_key_missing=cfg.admin_key is None)
        self.group_commit = GroupCommit(self.registry, self.store, self.recovery, self.checks, self.stats,
                                        publisher or NullSink())
        self.timers = LoopTimers(self.registry, self.stats, session_timeout_s=cfg.session_timeout_s)
        self._stop = False
        self.ctx: zmq.Context | None = None
        self.router = RouterSocket(self.stats, endpoint=cfg.endpoint, ipc_path=cfg.ipc_path, send_hwm=cfg.send_hwm,
                                   max_message_bytes=cfg.max_message_bytes)
        self.hooks = LoopHooks(cfg, self.registry, self.stats, externals=self.handlers.external_rows)

    def new_registry(self, incarnation: str) -> Registry:
        cfg = self.cfg
        settings = cfg.node_tier_settings()
        return Registry(incarnation, session_timeout_s=cfg.session_timeout_s, max_sessions=cfg.max_sessions,
                        max_pools=cfg.max_pools, max_blocks=cfg.max_blocks, kv_events=self._kv_events,
                        node_tiers=NodeTiers(settings, self._kv_events) if settings is not None else None)

    @property
    def sock(self) -> zmq.Socket | None:
        """The bound ROUTER socket (None before ``bind`` and after ``close``)."""
        return self.router.sock

    @property
    def publisher(self) -> EventSink:
        """Where the committed iteration's KV events go (manager/group_commit.py)."""
        return self.group_commit.publisher

    @property
    def incarnation(self) -> str:
        return self.registry.incarnation

    @property
    def mode(self) -> str:
        """``active``, or why it is not serving (manager/store/recovery.py ``INACTIVE``)."""
        return self.recovery.mode

    @property
    def exit_code(self) -> int:
        return self.recovery.exit_code

    def request_stop(self) -> None:
        """Stops after the current iteration (safe from a signal handler)."""
        self._stop = True

    # -- one message, no sockets -----------------------------------------------------------

    def handle_payload(self, payload: bytes, now: float, envelope: tuple[bytes, ...] | None = None) -> bytes | None:
        """Decodes, validates and dispatches one request (manager/dispatch.py); returns the
        encoded reply, or None when a forked check answers it later (only with the ``envelope``
        its reply needs)."""
        answer = self.dispatcher.handle(payload, now, envelope)
        return None if answer is None else answer.encode()

    def handle_frames(self, frames: list[bytes], now: float) -> list[bytes] | None:
        """[routing-id, payload] or [routing-id, b"", payload] -> reply frames; None to drop."""
        answer = self.dispatcher.handle_frames(frames, now)
        return None if answer is None else answer.frames()

    # -- the loop --------------------------------------------------------------------------

    def bind(self) -> None:
        cfg = self.cfg
        self.ctx = zmq.Context()
        sock = self.router.bind(self.ctx, self.hooks.secure)
        self.group_commit.publish_to(self.hooks.start(self.ctx, sock, self.publisher))
        self.handlers.open_configured(cfg.vllm_events_endpoint, cfg.attach)  # manager/external/ops.py
        logger.info("manager %s listening on %s", self.incarnation, cfg.endpoint)

    def run(self) -> None:
        """Serves until ``request_stop`` (SIGTERM, the shutdown op); binds first if needed."""
        if self.sock is None:
            self.bind()
        if self.store.durable:
            self._activate(time.monotonic())  # CorruptState propagates: never serve part of a state
        else:
            self.store.load(self.registry, time.monotonic())
        self.hooks.ready()  # READY=1: bound and recovered
        try:
            with self.timers.collecting_when_idle():  # the state is large and acyclic (manager/timers.py)
                while not self._stop:
                    self._maybe_gc(idle=not self.run_once(MAX_POLL_MS))
        finally:
            self.hooks.stopping()
            self.close()
        logger.info("manager %s stopped", self.incarnation)

    def run_once(self, timeout_ms: int) -> int:
        """One iteration; returns how many messages it handled."""
        sock = self.sock
        if sock is None:
            raise RuntimeError("Server.run_once before bind()")
        batch: list[list[bytes]] = []
        held: list[tuple] = []  # timings of the messages whose replies wait for the commit
        if self.busy_poll.wait(lambda: self.hooks.ready_now(sock)) or self.hooks.wait(sock, timeout_ms):
            t0, c0 = time.perf_counter(), time.thread_time()
            max_batch, clock = self.cfg.max_batch, time.perf_counter
            slice_ends = t0 + self.cfg.max_batch_ms / 1000 if self.cfg.max_batch_ms else float("inf")
            now = time.monotonic()
            # nothing to commit or publish first: each reply goes out as its message is handled
            keep = None if self._reply_at_once() else held
            answers: list[Answer | None] = []
            while True:  # asks the socket whether more are queued, not a recv that raises when none is
                try:
                    frames = sock.recv_multipart(_NOBLOCK)
                except zmq.Again:  # rare: the wait said one was ready
                    break
                batch.append(frames)
                answer = self._handle_timed(frames, now, t0, keep)
                if answer is not None:
                    answers.append(answer)
                # the slice: ZeroMQ hands out the clients' messages in turn, so a flood leaves
                # the others a message each per round and the iteration ends within max_batch_ms
                if len(batch) >= max_batch or clock() >= slice_ends or not sock.getsockopt(_EVENTS) & _POLLIN:
                    break
        else:
            now, answers = time.monotonic(), []
        if self.mode == "active":
            if self.timers.expiry_due(now):
                self._expire(now)
            replies = self._commit(answers)
        else:  # not serving: the answers are errors that changed nothing, and nothing is committed
            replies = [answer.frames() for answer in answers if answer is not None]
            if now >= self.recovery.next_activate:
                self._activate(now)
        sending = time.perf_counter()
        self.router.send(replies)
        for who, start, handled, cpu in held:
            self.stats.message_times.observe(who, t0, start, handled, sending, cpu)
        if batch:
            done = time.perf_counter()
            self.stats.observe_iteration(done - t0, time.thread_time() - c0, len(batch))
            self.busy_poll.busy(t0, done)
        self.stats.iterations += 1
        self.hooks.tick(now)
        return len(batch)

    def _handle_timed(self, frames: list[bytes], now: float, ready: float,
                      held: list[tuple] | None) -> Answer | None:
        """``handle_frames``, timed for manager/message_times.py. ``held`` None: the reply goes
        out at once and its row is kept; else the answer is returned (encoded once the commit's
        outcome is known) and its timings appended
        to ``held``, whose rows are kept once the iteration's replies start to leave. ``sent``
        is taken before the send, never after it: a client woken by its reply may run before
        the loop does again. A message that leaves no reply in this iteration (a dropped
        envelope, a forked check) keeps no row."""
        clock, cpu = time.perf_counter, time.thread_time
        dispatcher = self.dispatcher
        start, c0 = clock(), cpu()
        answer = dispatcher.handle_frames(frames, now)
        if held is not None:
            handled, used = clock(), cpu() - c0
            if answer is not None:
                held.append((dispatcher.who, start, handled, used))
            return answer
        if answer is not None:
            reply = answer.frames()  # nothing to commit first: the outcome is known
            handled, used = clock(), cpu() - c0
            self.stats.message_times.observe(dispatcher.who, ready, start, handled, handled, used)
            self.router.send([reply])
        return None

    def _reply_at_once(self) -> bool:
        """Replies go out as each message is handled, instead of after the iteration's commit,
        when the commit holds nothing back: no persistence and no KV events (group commit is
        for durability and for events published before replies). A client behind others in
        the same iteration then waits for the messages ahead of it, not for the whole batch."""
        return not self.store.durable and not self._kv_events and self.mode == "active"

    # -- the iteration's steps, each its owner's (manager/timers.py, manager/group_commit.py) ----

    def _maybe_gc(self, idle: bool) -> None:
        self.timers.maybe_gc(idle)

    def _expire(self, now: float) -> None:
        self.timers.expire(now)

    def _commit(self, answers: list[Answer | None] | None = None) -> list[list[bytes]]:
        return self.group_commit.commit(answers)

    def _activate(self, now: float) -> None:
        """Takes the lease and recovers the state: at start, as a standby, after a store failure;
        then freezes the state just loaded (settle_heap)."""
        if self.recovery.activate(now):
            self.handlers.sync_attachments()  # the state's attached vLLM servers (manager/external/)
            self.timers.expire_soon()
            self.stats.observe_frozen(settle_heap())

    def close(self) -> None:
        self.checks.close()
        self.handlers.close_external()
        self.router.close()
        self.hooks.close_sockets()  # event sockets and the ZAP thread live in self.ctx
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        self.hooks.close()
        self.store.shutdown(self.registry if self.mode == "active" else None)
        self.store.close()
        self.publisher.close()
