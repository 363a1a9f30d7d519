"""The manager daemon: one single-threaded loop over a ROUTER socket owns every pool.

Each iteration: wait for a message (or the next expiry check; after a busy iteration the wait
first spins a bounded, adaptive window: manager/busy_poll.py), read every ready message (up to
``max_batch``), handle them in arrival order, expire silent sessions, commit the iteration's
mutations to the store, hand the pools' KV events to the publisher, then send the replies.
Without persistence and KV events there is nothing to commit or publish first, and each reply
leaves as soon as its message is handled.
Nothing a client sends can kill the loop: bad input becomes an error reply (or, with a
malformed envelope, a counted drop) and changes nothing. Framing: shared/protocol.py.
CURVE, KV-event sockets, metrics and systemd notify hang off the loop in manager/loop_hooks.py.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import uuid

import zmq

from kvpool.manager.busy_poll import BusyPoll
from kvpool.manager.check_job import CheckJobs, Waiter
from kvpool.manager.config import ManagerConfig
from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.guards import Bounds
from kvpool.manager.handlers import Handlers
from kvpool.manager.loop_hooks import LoopHooks
from kvpool.manager.registry import Registry, Session
from kvpool.manager.stats import ServerStats
from kvpool.manager.store.base import (
    EventSink,
    Fenced,
    NullSink,
    StateStore,
    StoreUnavailable,
)
from kvpool.manager.store.recovery import INACTIVE, Recovery, open_store, settle_heap
from kvpool.shared.bind import ensure_private_dir, runtime_dir
from kvpool.shared.protocol import (
    SUPPORTED_VERSIONS,
    ManagerError,
    error_reply,
    max_containers,
    ok_reply,
    short_repr,
    unpack,
)

logger = logging.getLogger(__name__)

# The dispatch table. op -> (handler method, needs a session, admin op).
OPS: dict[str, tuple[str, bool, bool]] = {
    "hello": ("hello", False, False),
    "register": ("register", True, False),
    "step": ("step", True, False),
    "lookup": ("lookup", True, False),
    "locate": ("locate", True, False),
    "workers": ("workers", True, False),
    "heartbeat": ("heartbeat", True, False),
    "stats": ("stats", True, False),
    "deregister": ("deregister", True, False),
    "pools": ("pools", True, True),
    "sessions": ("sessions", True, True),
    "requests": ("requests", True, True),
    "reset_cache": ("reset_cache", True, True),
    "evict": ("evict", True, True),
    "drain": ("drain", True, True),
    "shutdown": ("shutdown", True, True),
    "drop_pool": ("drop_pool", True, True),
    "check": ("check", True, True),
    "cached_hashes": ("cached_hashes", True, True),
}
MAX_POLL_MS = 100  # the loop wakes at least this often (expiry checks, stop requests)
GC_EVERY_S = 30.0  # cyclic garbage is collected in an idle iteration at most this often
Handler = tuple  # (bound method, needs_session, admin)
NO_WHO = (-1, -1, "")  # a message that named no session, id or known op (manager/message_times.py)
# Plain ints: pyzmq's enum members cost more to look up and combine than the call they flag.
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


class Server:
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
        self.stats = ServerStats()
        self.store: StateStore = store or open_store(cfg)
        self.recovery = Recovery(self.store, self.registry, lease_ms=cfg.lease_ms, new_registry=self.new_registry,
                                 errors=self.stats.errors, request_stop=self.request_stop)
        self.publisher: EventSink = publisher or NullSink()
        self.handlers = Handlers(
            self.registry, self.stats, max_sub_ops=cfg.max_sub_ops, max_message_bytes=cfg.max_message_bytes,
            admin_key=cfg.admin_key, request_stop=self.request_stop,
            bounds=Bounds(cfg.max_step_blocks, cfg.max_session_blocks, cfg.max_total_blocks, cfg.max_model_len),
        )
        self.handlers.store_stats = self.store.stats
        self.handlers.events_info = {"events_endpoint": cfg.events_endpoint,
                                     "events_replay_endpoint": cfg.events_replay_endpoint}
        self.handlers.admin_needs_key = bool(cfg.curve_secret_key_file)  # CURVE keys are not admin keys
        self._dispatch: dict[str, Handler] = {
            op: (getattr(self.handlers, name), needs_session, admin) for op, (name, needs_session, admin) in OPS.items()
        }
        self._max_objects = max_containers(cfg.max_sub_ops)  # maps + arrays decoded per message
        self._stop = False
        self._expiry_every = min(cfg.session_timeout_s / 4, 1.0)
        self._next_expiry = 0.0
        self._next_gc = 0.0
        self._who = NO_WHO  # (session number, message id, op) of the message handled last
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.hooks = LoopHooks(cfg, self.registry, self.stats)
        self.busy_poll = BusyPoll(cfg.busy_poll_us / 1e6)
        self.stats.busy_poll = self.busy_poll
        self.checks = CheckJobs(self.registry, self.stats.errors)  # `check` of a large state: a forked child

    def new_registry(self, incarnation: str) -> Registry:
        cfg = self.cfg
        return Registry(incarnation, session_timeout_s=cfg.session_timeout_s, max_sessions=cfg.max_sessions,
                        max_pools=cfg.max_pools, max_blocks=cfg.max_blocks, kv_events=self._kv_events)

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
        """Decodes, validates and dispatches one request; returns the encoded reply, or None
        when a forked check answers it later (only with the ``envelope`` its reply needs)."""
        self.stats.messages += 1
        msg_id = None
        reg = self.registry
        inc, state, seq = reg.incarnation, reg.state_id, None
        try:
            if len(payload) > self.cfg.max_message_bytes:
                raise ManagerError("too_large", f"{len(payload)} bytes; the limit is {self.cfg.max_message_bytes}")
            try:
                msg = unpack(payload, self._max_objects)
            except Exception as e:  # msgpack raises several types; none may escape
                raise ManagerError("bad_message", f"payload is not one msgpack value: {e}") from None
            if type(msg) is not dict:
                raise ManagerError("bad_message", f"a request must be a msgpack map, got {type(msg).__name__}")
            msg_id = msg.get("id")
            if type(msg_id) is not int or not 0 <= msg_id < 1 << 64:
                msg_id = None
                raise ManagerError("bad_message", "field 'id' must be a uint64")
            if self.mode != "active":
                raise ManagerError(*INACTIVE[self.mode])
            seq = reg.seq if reg.durable else None
            handler, sess, args = self._resolve(msg, now)
            self._who = (sess.num if sess is not None else -1, msg_id, msg["op"])
            if envelope is not None and msg["op"] == "check" and self.checks.forks():
                self.checks.add(Waiter(envelope, msg_id, inc, state, _pending_seq(reg, seq)))
                return None
            self.handlers.msg_id = msg_id
            body = handler(sess, args, now)
            return ok_reply(msg_id, inc, body, state, _pending_seq(reg, seq))
        except ManagerError as e:
            self.stats.errors[e.code] += 1
            return error_reply(msg_id, inc, e, state, _pending_seq(reg, seq))
        except Exception:
            logger.exception("internal error handling a message")
            self.stats.errors["internal"] += 1
            return error_reply(msg_id, inc, ManagerError("internal", "manager error; see its log"), state,
                               _pending_seq(reg, seq))

    def _resolve(self, msg: dict, now: float) -> tuple:
        v = msg.get("v")
        if type(v) is not int or v not in SUPPORTED_VERSIONS:
            raise ManagerError("unsupported_version", f"version {short_repr(v, 20)} unsupported; manager speaks "
                               f"{list(SUPPORTED_VERSIONS)}", {"versions": list(SUPPORTED_VERSIONS)})
        op = msg.get("op")
        entry = self._dispatch.get(op) if type(op) is str else None
        if entry is None:
            raise ManagerError("unknown_op", f"unknown op {short_repr(op, 40)}; known: {sorted(OPS)}")
        args = msg.get("args", {})
        if type(args) is not dict:
            raise ManagerError("bad_message", f"field 'args' must be a map, got {type(args).__name__}")
        handler, needs_session, admin = entry
        sess: Session | None = None
        if needs_session:
            sid = msg.get("sid")
            sess = self.registry.sessions.get(sid) if type(sid) is str else None
            if sess is None:
                raise ManagerError("unknown_session", "no such session (expired, ended, or the manager "
                                   "restarted): hello again; requests of the old session are gone")
            sess.last_seen = now
            self.recovery.check_seen(msg.get("seq"))
            if admin and not sess.admin:
                raise ManagerError("forbidden", f"op {op!r} is an admin op: hello with role 'admin' and the admin key"
                                   + (" (with CURVE on, the manager needs admin_key set for admin ops)"
                                      if self.cfg.admin_key is None else ""))
        self.stats.ops[op] += 1
        return handler, sess, args

    def handle_frames(self, frames: list[bytes], now: float) -> list[bytes] | None:
        """[routing-id, payload] or [routing-id, b"", payload] -> reply frames; None to drop."""
        if len(frames) == 2 or (len(frames) == 3 and not frames[1]):
            envelope = tuple(frames[:-1])
            reply = self.handle_payload(frames[-1], now, envelope)
            return None if reply is None else [*envelope, reply]
        self.stats.dropped += 1
        return None

    # -- the loop --------------------------------------------------------------------------

    def bind(self) -> None:
        cfg = self.cfg
        if cfg.ipc_path:
            directory = os.path.dirname(cfg.ipc_path) or "."
            if os.path.abspath(directory) == os.path.abspath(runtime_dir()):  # the default: must be ours alone
                ensure_private_dir(directory)
            else:
                os.makedirs(directory, mode=0o700, exist_ok=True)
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be queued raises: we count it
        sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * cfg.max_message_bytes)  # beyond this the peer is cut off
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            self.hooks.secure(self.ctx, sock)  # CURVE, before bind
            sock.bind(cfg.endpoint)
        except (zmq.ZMQError, ValueError):
            sock.close(linger=0)  # an open socket would block the context's term()
            raise
        self.sock = sock
        self.publisher = self.hooks.start(self.ctx, sock, self.publisher)
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
        # The state is acyclic and large (per-block lists, the hash map): automatic collections
        # would traverse all of it every few thousand allocations. Collect when idle instead.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            while not self._stop:
                self._maybe_gc(idle=not self.run_once(MAX_POLL_MS))
        finally:
            self.hooks.stopping()
            if gc_was_enabled:
                gc.enable()
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
            max_batch = self.cfg.max_batch
            while True:  # asks the socket whether more are queued, not a recv that raises when none is
                try:
                    batch.append(sock.recv_multipart(_NOBLOCK))
                except zmq.Again:  # rare: the wait said one was ready
                    break
                if len(batch) >= max_batch or not sock.getsockopt(_EVENTS) & _POLLIN:
                    break
            now = time.monotonic()
            if self._reply_at_once():
                for frames in batch:  # nothing to commit or publish first: each reply goes out at once
                    self._handle_timed(frames, now, t0, None)
                replies = []
            else:
                replies = [self._handle_timed(frames, now, t0, held) for frames in batch]
        else:
            now, replies = time.monotonic(), []
        if self.mode == "active":
            if now >= self._next_expiry:
                self._expire(now)
            replies = self._commit(replies)
        elif now >= self.recovery.next_activate:
            self._activate(now)
        sending = time.perf_counter()
        self._send(replies)
        for who, start, handled, cpu in held:
            self.stats.message_times.observe(who, t0, start, handled, sending, cpu)
        if batch:
            done = time.perf_counter()
            self.stats.observe_iteration(done - t0, time.thread_time() - c0, len(batch))
            self.busy_poll.busy(t0, done)
        self.stats.iterations += 1
        self.hooks.tick(now)
        return len(batch)

    def _handle_timed(self, frames: list[bytes], now: float, ready: float, held: list[tuple] | None) -> list | None:
        """``handle_frames``, timed for manager/message_times.py. ``held`` None: the reply goes
        out at once and its row is kept; else the reply is returned and its timings appended
        to ``held``, whose rows are kept once the iteration's replies start to leave. ``sent``
        is taken before the send, never after it: a client woken by its reply may run before
        the loop does again. A message that leaves no reply in this iteration (a dropped
        envelope, a forked check) keeps no row."""
        clock, cpu = time.perf_counter, time.thread_time
        self._who = NO_WHO
        start, c0 = clock(), cpu()
        reply = self.handle_frames(frames, now)
        handled, used = clock(), cpu() - c0
        if held is not None:
            if reply is not None:
                held.append((self._who, start, handled, used))
            return reply
        if reply is not None:
            self.stats.message_times.observe(self._who, ready, start, handled, handled, used)
            self._send([reply])
        return None

    def _reply_at_once(self) -> bool:
        """Replies go out as each message is handled, instead of after the iteration's commit,
        when the commit holds nothing back: no persistence and no KV events (group commit is
        for durability and for events published before replies). A client behind others in
        the same iteration then waits for the messages ahead of it, not for the whole batch."""
        return not self.store.durable and not self._kv_events and self.mode == "active"

    def _maybe_gc(self, idle: bool) -> None:
        """A full collection in an idle iteration, at most every GC_EVERY_S (10x that if never idle)."""
        now = time.monotonic()
        if now >= self._next_gc and (idle or now >= self._next_gc + 9 * GC_EVERY_S):
            t0 = time.perf_counter()
            gc.collect()
            self.stats.observe_gc(time.perf_counter() - t0)
            self._next_gc = now + GC_EVERY_S

    def _expire(self, now: float) -> None:
        self._next_expiry = now + self._expiry_every
        for sess, freed in self.registry.expire(now):
            self.stats.sessions_expired += 1
            self.stats.expired_requests_freed += freed
            logger.warning("session %d (%s) silent for %.1fs: expired, %d requests freed",
                           sess.num, sess.identity, now - sess.last_seen, freed)

    def _commit(self, replies: list | None = None) -> list:
        """Store commit, then KV events: both before any reply of this iteration goes out.

        The store is called every iteration (it renews its lease when idle). A failed commit
        acknowledges nothing: the iteration's replies become errors (manager/store/recovery.py).
        """
        reg = self.registry
        if self.recovery.went_back is not None:  # a client saw commits this state lacks: acknowledge nothing
            return self.recovery.lost_store(StoreUnavailable(self.recovery.went_back), replies or [])
        t0 = time.perf_counter()
        try:
            self.store.commit(reg, reg.dirty)
        except (StoreUnavailable, Fenced) as e:
            return self.recovery.lost_store(e, replies or [])
        if reg.dirty:
            self.stats.commit_latency.observe(time.perf_counter() - t0)
            reg.dirty = set()
        batches = reg.orphan_events
        reg.orphan_events = []
        for name, entry in reg.pools.items():
            events = entry.pool.take_events() if entry.pool is not None else []
            if events:
                batches.append((name, entry.epoch, events))
        for name, epoch, events in batches:
            self.publisher.publish(name, epoch, events)
            self.stats.event_batches += 1
            self.stats.events += len(events)
        return (replies or []) + self.checks.poll()  # forked checks that finished (they mutate nothing)

    def _activate(self, now: float) -> None:
        """Takes the lease and recovers the state: at start, as a standby, after a store failure;
        then freezes the state just loaded (settle_heap)."""
        if self.recovery.activate(now):
            self._next_expiry = 0.0
            self.stats.frozen = settle_heap()

    def _send(self, replies: list[list[bytes] | None]) -> None:
        sock = self.sock
        for frames in replies:
            if frames is None:
                continue
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)  # type: ignore[union-attr]
                self.stats.replies += 1
            except zmq.ZMQError:  # EAGAIN (client not reading) or EHOSTUNREACH (client gone)
                self.stats.replies_dropped += 1

    def close(self) -> None:
        self.checks.close()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            if self.cfg.ipc_path and os.path.exists(self.cfg.ipc_path):
                os.unlink(self.cfg.ipc_path)  # libzmq leaves the socket file behind
        self.hooks.close_sockets()  # event sockets and the ZAP thread live in self.ctx
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        self.hooks.close()
        self.store.shutdown(self.registry if self.mode == "active" else None)
        self.store.close()
        self.publisher.close()


def _pending_seq(reg: Registry, seq: int | None) -> int | None:
    """The commit sequence a reply carries: the batch this iteration commits when it mutated
    (the reply goes out only after that commit, or its queueing under async)."""
    return None if seq is None else seq + (1 if reg.log else 0)


def already_running(endpoint: str, timeout_ms: int = 300) -> bool:
    """True when a manager answers a hello at ``endpoint`` (binding an ipc path would steal it)."""
    from kvpool.shared.protocol import encode_request

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode_request(0, "heartbeat", None, {}))  # answered (unknown_session), creates nothing
        return bool(sock.poll(timeout_ms, zmq.POLLIN))
    finally:
        sock.close()


def serve(cfg: ManagerConfig) -> int:
    """The daemon's entry point: SIGTERM or SIGINT stops it after the current iteration."""
    if cfg.ipc_path and os.path.exists(cfg.ipc_path) and already_running(cfg.endpoint):
        raise RuntimeError(f"a manager is already running at {cfg.endpoint}; stop it or pick another endpoint")
    server = Server(cfg)
    try:
        server.bind()
    except (OSError, zmq.ZMQError) as e:
        server.close()
        raise RuntimeError(f"cannot bind {cfg.endpoint}: {e}") from None
    except (RuntimeError, ValueError):  # an extra socket or the metrics port (manager/loop_hooks.py)
        server.close()
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: server.hooks.request_reload())  # re-read allowed CURVE keys
    # The start-up heap (every imported module, the config, the sockets) lives as long as the
    # process: out of the collector's sight, the loop's full collections (idle, or forced after
    # 10 * GC_EVERY_S of nonstop traffic) walk only what came since, not ~35k objects for ~20 ms
    # (a durable manager settles again once its state is loaded)
    server.stats.frozen = settle_heap()
    try:
        server.run()
    except CorruptState as e:
        raise RuntimeError(f"refusing to serve a corrupt or partial state: {e}. Inspect it with `kvpool "
                           "snapshot`; put a good one back with `kvpool restore`") from None
    return server.exit_code
