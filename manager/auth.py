"""CURVE on the manager's control socket: encryption plus a list of allowed client keys.

With ``curve_secret_key_file`` set, the ROUTER socket is a CURVE server and a ZAP handler
(pyzmq's ``ThreadAuthenticator``, which runs in its own thread by design and touches no loop
state) accepts a connection only when the client's public key is one of the ``*.key`` files in
``curve_allowed_keys_dir``. A client without CURVE, or with another key, never completes the
handshake: it gets no reply at all. ``reload`` re-reads the directory (the daemon does it on
SIGHUP). Admin ops still need the admin key on top (``admin_key``, PROTOCOL.md section 4).
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvpool.shared.curve import read_keypair

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "kvpool"  # the socket's ZAP domain; the authenticator's key list is filed under it


class CurveServer:
    def __init__(self, ctx: zmq.Context, secret_key_file: str, allowed_keys_dir: str) -> None:
        self.public, self.secret = read_keypair(secret_key_file)
        self.allowed_dir = allowed_keys_dir
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvpool.manager.zap"))
        self.auth.start()
        self.reload()

    def reload(self) -> int:
        """Re-reads the allowed keys; returns how many there are."""
        self.auth.configure_curve(domain=ZAP_DOMAIN, location=self.allowed_dir)
        n = self.num_allowed
        if n == 0:
            logger.warning("CURVE: no *.key files in %s: every client is refused", self.allowed_dir)
        else:
            logger.info("CURVE: %d allowed client keys from %s", n, self.allowed_dir)
        return n

    @property
    def num_allowed(self) -> int:
        return len(self.auth.certs.get(ZAP_DOMAIN, {}))

    def apply(self, sock: zmq.Socket) -> None:
        """Makes ``sock`` a CURVE server (before bind)."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.zap_domain = ZAP_DOMAIN.encode()

    def close(self) -> None:
        self.auth.stop()
