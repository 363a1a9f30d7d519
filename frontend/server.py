"""Running the front door: uvicorn on a socket bound here (port 0 picks a free port), in this
thread (`kvpool serve`) or a background one (tests, the demo, bench_router)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from kvpool.frontend.app import create_app
from kvpool.frontend.http_limits import HTTPLimits
from kvpool.frontend.service import FrontDoor, FrontDoorConfig


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made as uvicorn makes its own. ``IPPROTO_TCP`` is named, not left to
    the default 0: asyncio sets TCP_NODELAY on an accepted connection only when the socket says
    it is TCP, and without it a response written in two parts (headers, then body) waits for
    the client's delayed ACK, 40 ms on every keep-alive request (Nagle's algorithm)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Uvicorn(uvicorn.Server):
    def stop(self) -> None:
        """Asks the serving loop to shut down gracefully (uvicorn's own flag, as its signal
        handler sets it)."""
        self.should_exit = True


class FrontDoorServer:
    """One front door: ``start()`` serves it in a daemon thread; ``url`` is its base URL."""

    def __init__(self, cfg: FrontDoorConfig, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 *, limits: HTTPLimits | None = None, api_keys: tuple[str, ...] | list[str] = ()):
        limits = limits or HTTPLimits()
        self.frontdoor = FrontDoor(cfg)
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        app = create_app(self.frontdoor, api_keys=tuple(api_keys), body_timeout_s=limits.body_timeout_s)
        self.server = _Uvicorn(uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False, http=limits.protocol(),
            limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.keep_alive_s))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serves in this thread until SIGINT/SIGTERM."""
        self.server.run(sockets=[self.sock])

    def start(self, timeout_s: float = 30.0) -> FrontDoorServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                        name="frontdoor", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the front door did not start (see its log)")
            time.sleep(0.02)
        return self

    def wait_for_workers(self, model: str, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.frontdoor.directory.serving(model)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} workers of {model!r} did not appear at the front door in {timeout_s}s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.stop()
        if self._thread is not None:
            self._thread.join(15)
        self.sock.close()
