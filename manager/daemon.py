"""The manager daemon's process: its entry point ``serve`` (what ``kvpool manager`` runs), the
signals it answers, and the probe that refuses a second manager on the same ipc path.
The loop itself is manager/server.py's ``Server``.
"""

from __future__ import annotations

import os
import signal

import zmq

from kvpool.manager.config import ManagerConfig
from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.server import Server
from kvpool.manager.store.recovery import settle_heap
from kvpool.shared.protocol import encode_request


def already_running(endpoint: str, timeout_ms: int = 300) -> bool:
    """True when a manager answers a hello at ``endpoint`` (binding an ipc path would steal it)."""
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
    server.stats.observe_frozen(settle_heap())
    try:
        server.run()
    except CorruptState as e:
        raise RuntimeError(f"refusing to serve a corrupt or partial state: {e}. Inspect it with `kvpool "
                           "snapshot`; put a good one back with `kvpool restore`") from None
    return server.exit_code
