"""Bounds on the front door's HTTP connections, so idle or trickling clients cannot hold it.

uvicorn bounds concurrent requests (``limit_concurrency``: a request beyond it gets a 503) and the
idle time between requests of a kept-alive connection (``timeout_keep_alive``), but a connection
that sends no request, or sends its headers a byte at a time, is held for ever. ``BoundedH11``
adds the two missing bounds on top of uvicorn's h11 protocol:

- ``max_connections``: a connection beyond it is closed as soon as it is accepted;
- ``header_timeout_s``: a connection whose request line and headers are not complete that long
  after it opened (or after its previous response) is closed.

The body's own deadline is the app's (frontend/body.py: 408 after ``body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPLimits:
    max_connections: int = 4096  # open connections; more are closed at once
    limit_concurrency: int = 2048  # requests in progress; more get a 503
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    body_timeout_s: float = 30.0  # the whole body within this (408)
    keep_alive_s: float = 5.0  # idle time between two requests of one connection

    def __post_init__(self) -> None:
        for name in ("max_connections", "limit_concurrency"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not 0 < v <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {v!r}")

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's ``http`` protocol class with these bounds."""
        limits = self

        class Protocol(BoundedH11):
            max_connections = limits.max_connections
            header_timeout_s = limits.header_timeout_s

        return Protocol


class BoundedH11(H11Protocol):
    max_connections = 4096
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning("%d connections open: closing a new one (max_connections)", len(self.connections) - 1)
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers have the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
