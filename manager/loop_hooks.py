"""What hangs off the manager loop besides the store: CURVE, KV-event sockets, metrics, systemd notify.

Everything here is optional (docs/operating.md) and driven by the loop's thread, which calls:

    secure(ctx, sock)         before binding the ROUTER: CURVE server + ZAP (manager/auth.py)
    start(ctx, sock, pub)     after binding: KV-event PUB/replay sockets, the metrics endpoint
    ready()                   once the store's state is recovered: READY=1
    wait(sock, timeout_ms)    instead of ``sock.poll``: also serves event replay requests
    ready_now(sock)           the same without blocking, cheap: the busy-poll loop's check
    tick(now)                 every iteration: WATCHDOG=1, STATUS=, metrics text, key reloads
    stopping(), close()

systemd's protocol (shared/notify.py) is a no-op outside systemd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from kvpool.manager.auth import CurveServer
from kvpool.manager.config import ManagerConfig
from kvpool.manager.events import EventPublisher, LoopPublisher
from kvpool.manager.metrics import ManagerMetrics
from kvpool.manager.registry import Registry
from kvpool.manager.stats import ServerStats
from kvpool.manager.store.base import EventSink, NullSink
from kvpool.shared.node_tier import NODE_TOPIC
from kvpool.shared.notify import Notifier

logger = logging.getLogger(__name__)
STATUS_EVERY_S = 5.0  # systemd STATUS= refresh
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: the busy-poll asks this in a loop


class LoopHooks:
    def __init__(self, cfg: ManagerConfig, registry: Registry, stats: ServerStats,
                 externals: Callable[[], list[dict]] = list) -> None:
        self.cfg, self.reg, self.stats = cfg, registry, stats
        self.externals = externals  # the attached servers' rows, for the metrics
        self.notifier = Notifier()
        self.curve: CurveServer | None = None
        self.metrics: ManagerMetrics | None = None
        self.events: LoopPublisher | None = None
        self._poller: zmq.Poller | None = None  # the ROUTER plus the replay socket
        self._reload = False
        self._next_status = 0.0

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        cfg = self.cfg
        if cfg.curve_secret_key_file and cfg.curve_allowed_keys_dir:
            self.curve = CurveServer(ctx, cfg.curve_secret_key_file, cfg.curve_allowed_keys_dir)
            self.curve.apply(sock)

    def start(self, ctx: zmq.Context, sock: zmq.Socket, publisher: EventSink) -> EventSink:
        """Binds the configured extras; returns the publisher the loop should use."""
        cfg = self.cfg
        if cfg.events_endpoint and isinstance(publisher, NullSink):
            try:
                pub = EventPublisher(ctx, cfg.events_endpoint, cfg.events_replay_endpoint, cfg.events_buffer,
                                     cfg.events_format)
            except zmq.ZMQError as e:
                raise RuntimeError(f"cannot bind the KV events sockets {cfg.events_endpoint} / "
                                   f"{cfg.events_replay_endpoint}: {e}; change events_endpoint") from None
            publisher = self.events = LoopPublisher(pub, self.block_size)
            logger.info("KV events on %s (replay: %s) in the %s format", cfg.events_endpoint,
                        cfg.events_replay_endpoint or "off", cfg.events_format)
            if self.events.replay_socket is not None:
                self._poller = zmq.Poller()
                self._poller.register(sock, zmq.POLLIN)
                self._poller.register(self.events.replay_socket, zmq.POLLIN)
        if cfg.metrics_port:
            try:
                self.metrics = ManagerMetrics(self.reg, self.stats, cfg.metrics_host, cfg.metrics_port,
                                              externals=self.externals)
            except OSError as e:
                raise RuntimeError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {e}; "
                                   "change metrics_port (0: off)") from None
            logger.info("metrics on http://%s:%d/metrics", cfg.metrics_host, self.metrics.port)
        return publisher

    def block_size(self, name: str) -> int:
        """From the shards' spec: a pool that just lost a shard has no Pool, but its events go out.
        A dropped pool's last batch is only AllBlocksCleared, which has no block size. A node
        tier's topic: its tier's."""
        if name.startswith(NODE_TOPIC):
            tier = self.reg.node.tiers.get(name[len(NODE_TOPIC):]) if self.reg.node is not None else None
            return tier.block_size if tier is not None else 0
        entry = self.reg.pools.get(name)
        return entry.spec.block_size if entry is not None else 0

    def wait(self, sock: zmq.Socket, timeout_ms: int) -> bool:
        """Waits for a request; answers event replay requests meanwhile. True when one is ready."""
        if self._poller is None:
            return bool(sock.poll(timeout_ms, zmq.POLLIN))
        pending = self.events is not None and self.events.replay_pending
        ready = dict(self._poller.poll(0 if pending else timeout_ms))
        if self.events is not None and (self.events.replays or self.events.replay_socket in ready):
            self.events.serve_replay()  # a bounded slice of the replays in progress
        return sock in ready

    def ready_now(self, sock: zmq.Socket) -> bool:
        """``wait(sock, 0)`` for the busy-poll loop: without a replay socket, one getsockopt
        (no Poller built, no poll(2) when a command is already queued)."""
        if self._poller is None:
            return bool(sock.getsockopt(_EVENTS) & _POLLIN)
        return self.wait(sock, 0)

    def ready(self) -> None:
        self.notifier.ready(f"serving {self.cfg.endpoint}: {self.status()}")

    def tick(self, now: float) -> None:
        self.notifier.tick(now)
        if self.metrics is not None:
            self.metrics.maybe_update(now)
        if self.notifier.enabled and now >= self._next_status:
            self._next_status = now + STATUS_EVERY_S
            self.notifier.status(self.status())
        if self._reload:
            self._reload = False
            if self.curve is not None:
                self.curve.reload()
            else:
                logger.info("SIGHUP: nothing to reload (CURVE is off)")

    def request_reload(self) -> None:
        """Re-reads the allowed CURVE keys at the next tick (SIGHUP; safe from a handler)."""
        self._reload = True

    def status(self) -> str:
        reg = self.reg
        return (f"{len(reg.sessions)} sessions, {len(reg.pools)} pools, {reg.total_requests()} requests"
                f"{', draining' if reg.draining else ''}")

    def stopping(self) -> None:
        self.notifier.stopping()

    def close_sockets(self) -> None:
        """Before the context is terminated: the event sockets and the ZAP thread."""
        if self.events is not None:
            self.events.close()
            self.events = None
        self._poller = None
        if self.curve is not None:
            self.curve.close()
            self.curve = None

    def close(self) -> None:
        self.close_sockets()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
