"""Takes a sent step's reply off the socket while the worker computes (``begin_step``).

With overlap the reply to step N+1's message arrives during step N's forward pass; read after
it, the read (``recv``, msgpack decode, on caches the forward pass just evicted) is manager wait
the step is exposed to. One thread per client, parked in ``poll`` (no GIL held), reads and
decodes it as soon as it arrives: torch releases the GIL inside its ops, so the thread runs
beside the forward pass, and ``end_step`` finds the decoded reply waiting.

The socket is the thread's alone from ``start`` until ``Job.done`` is set: the client touches
it only after ``wait`` returned (ZeroMQ sockets are not thread-safe). A job ends by the
deadline it was given, so ``wait`` returns by then too.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import zmq

Take = Callable[[zmq.Socket, float, int], "dict | None"]


class Job:
    """One pending reply: ``reply`` is the decoded reply, or None when none came by the deadline."""

    __slots__ = ("sock", "deadline", "msg_id", "reply", "done")

    def __init__(self, sock: zmq.Socket, deadline: float, msg_id: int) -> None:
        self.sock, self.deadline, self.msg_id = sock, deadline, msg_id
        self.reply: dict | None = None
        self.done = threading.Event()

    def wait(self) -> dict | None:
        self.done.wait()
        return self.reply


class ReplyReceiver:
    """``take(sock, deadline, msg_id)`` is the client's own receive loop (no client state)."""

    def __init__(self, take: Take) -> None:
        self._take = take
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0  # the process that started the thread: a forked child has no thread

    def start(self, sock: zmq.Socket, deadline: float, msg_id: int) -> Job:
        if self._thread is None or self._pid != os.getpid():
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="kvpool-manager-reply", daemon=True)
            self._thread.start()
            self._pid = os.getpid()
        job = Job(sock, deadline, msg_id)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.reply = self._take(job.sock, job.deadline, job.msg_id)
            except zmq.ZMQError:  # the context is going away: the client gives up as on a timeout
                job.reply = None
            finally:
                job.done.set()

    def close(self) -> None:
        """Stops the thread (after the job in progress, which ends by its deadline)."""
        if self._thread is not None and self._pid == os.getpid():
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
