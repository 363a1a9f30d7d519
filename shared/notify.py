"""systemd's notify protocol (sd_notify) without libsystemd.

A service with ``Type=notify`` tells systemd it is ready by sending the datagram ``READY=1`` to
the AF_UNIX socket named in ``NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace).
With ``WatchdogSec=`` set, systemd passes ``WATCHDOG_USEC`` and expects ``WATCHDOG=1`` more often
than that; ``Watchdog.tick`` sends it at half the interval, from the service's own loop, so a
wedged loop is restarted. Outside systemd (no NOTIFY_SOCKET) every call is a no-op. A send never
blocks: when the receiver's queue is full the datagram is dropped (the loop must not wait on it).
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if addr:
            self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 1e6 / 2 if usec.isdigit() and watchdog_for_us else None
        self._last_tick = 0.0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Sends ``KEY=value`` lines as one datagram; False when not under systemd or it fails."""
        if self.address is None:
            return False
        msg = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(self.address)
                s.send(msg, socket.MSG_DONTWAIT)  # never block the caller's loop on a full socket
            return True
        except BlockingIOError:  # the receiver is not reading: drop this one (the next tick retries)
            log.debug("sd_notify to %s: its queue is full; dropped %r", self.address.lstrip("\0"), msg[:40])
            return False
        except OSError as e:
            log.warning("sd_notify to %s failed: %s", self.address.lstrip("\0"), e)
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def tick(self, now: float | None = None) -> bool:
        """Sends WATCHDOG=1 when half the watchdog interval has passed since the last one."""
        if self.watchdog_interval is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_tick < self.watchdog_interval:
            return False
        self._last_tick = now
        return self.send("WATCHDOG=1")
