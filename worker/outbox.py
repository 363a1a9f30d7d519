"""The generate socket's replies under flow control: nothing to a connected client is dropped.

A message ZeroMQ will not take now (the client's pipe is full: it reads slower than the worker
sends) waits in that client's backlog, in order, and goes out as the client reads: ``flush``
sends what each backlog's client takes, first thing each loop iteration. A backlog above
MAX_BACKLOG messages, or older than BACKLOG_TIMEOUT_S, fails its client: the server aborts the
client's requests, and their error messages replace the backlog. A send to a client whose
connection is gone (ROUTER_MANDATORY: EHOSTUNREACH) tells the server, which aborts its requests.
PROTOCOL.md section 12. The server (worker/server.py) owns the socket; the requests are
worker/generate_handler.py's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)
DROP_LOG_EVERY_S = 5.0
MAX_BACKLOG = 200_000
BACKLOG_TIMEOUT_S = 60.0


class Outbox:
    def __init__(self, sock: zmq.Socket, fail: Callable[[bytes, str], list[bytes]],
                 gone: Callable[[bytes], None]) -> None:
        """``fail(client, why)``: fails the client's requests, returns the messages that replace
        its backlog; ``gone(client)``: the client's connection is closed."""
        self._sock = sock
        self._fail = fail
        self._gone = gone
        self._backlog: dict[bytes, deque[bytes]] = {}  # client -> messages its pipe would not take yet
        self._backlog_since: dict[bytes, float] = {}
        self.replies_queued = 0  # messages that waited in a backlog (none is ever dropped)
        self.clients_failed = 0  # clients whose requests were failed for not reading
        self._next_drop_log = 0.0

    def backlogged(self) -> bool:
        return bool(self._backlog)

    def send(self, ident: bytes, payload: bytes) -> bool:
        """Sends one message, or queues it behind what the client has not read yet; False when the
        client is gone."""
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
            self._gone(ident)
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

    def flush(self) -> None:
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
                self._gone(ident)
                continue
            self._drop_backlog(ident)

    def _drop_backlog(self, ident: bytes) -> None:
        self._backlog.pop(ident, None)
        self._backlog_since.pop(ident, None)

    def _fail_client(self, ident: bytes, why: str) -> None:
        """The client does not read: its backlog is replaced by the error messages of the requests
        the server fails (it gets them if it ever reads again)."""
        self.clients_failed += 1
        queue = self._backlog.setdefault(ident, deque())
        queue.clear()
        self._backlog_since[ident] = time.monotonic()
        queue.extend(self._fail(ident, why))
