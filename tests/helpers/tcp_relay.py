"""A TCP relay a test can cut: a vLLM server's event publisher connects to it, and it forwards the
bytes to the manager's event socket. ``cut`` closes the listener and every connection (the
publisher's reconnects are refused: its events stop while its HTTP answers); ``restore``
listens again on the same port. ``blackhole`` swallows what the publisher sends from then on
(``discarded`` counts the bytes): ZeroMQ took those messages for sent, so after a ``cut`` and a
``restore`` they are lost for good, a real gap in the stream."""

from __future__ import annotations

import socket
import threading


class Relay:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target_port = host, target_port
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._blackhole = threading.Event()
        self.discarded = 0
        self.port = self._listen(0)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _listen(self, port: int) -> int:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.host, port))
        ls.listen(16)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return ls.getsockname()[1]

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection((self.host, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_publisher: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_publisher and self._blackhole.is_set():
                    self.discarded += len(data)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def blackhole(self) -> None:
        self._blackhole.set()

    def restore(self) -> None:
        self._blackhole.clear()
        self._listen(self.port)

    def close(self) -> None:
        self.cut()
