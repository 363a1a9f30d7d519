"""CURVE keys for the manager's control socket and the worker's generate socket: generate,
write, read, apply to a client socket, and serve (``CurveServer``).

A keypair is two text files in ZeroMQ's certificate format (what czmq and pyzmq's
``zmq.auth.load_certificate`` read), holding Z85-encoded 32-byte keys::

    NAME.key          public key only: hand it out; the manager's allowed-clients directory
                      holds one such file per client (``curve_allowed_keys_dir``)
    NAME.key_secret   public + secret key, mode 0600: stays with its owner

A client needs the manager's public key (the ``NAME.key`` file's path, or its 40-character Z85
text) and its own ``NAME.key_secret`` file. Clients read them from ``--curve-server-key`` /
``--curve-key-file`` or the environment ``KVPOOL_CURVE_SERVER_KEY`` / ``KVPOOL_CURVE_KEY_FILE``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

ENV_SERVER_KEY = "KVPOOL_CURVE_SERVER_KEY"
ENV_KEY_FILE = "KVPOOL_CURVE_KEY_FILE"
Z85_KEY_LEN = 40
ZAP_DOMAIN = "kvpool"  # the server sockets' ZAP domain; the authenticator's key list is filed under it
logger = logging.getLogger(__name__)


def _cert_text(name: str, public: bytes, secret: bytes | None) -> str:
    lines = [f"#   kvpool CURVE {'secret' if secret else 'public'} key {name!r} (ZeroMQ certificate)",
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_keypair(directory: str | Path, name: str = "kvpool", *, force: bool = False) -> tuple[Path, Path]:
    """Generates a keypair; returns (public file, secret file). The secret file is mode 0600."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name must be a plain file name, got {name!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = d / f"{name}.key", d / f"{name}.key_secret"
    if not force and (public_path.exists() or secret_path.exists()):
        raise ValueError(f"{public_path} or {secret_path} exists; pick another --name or pass --force")
    public, secret = zmq.curve_keypair()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(secret_path, flags, 0o600)
    os.fchmod(fd, 0o600)  # the umask cannot widen it, and an existing file is tightened
    with os.fdopen(fd, "w") as f:
        f.write(_cert_text(name, public, secret))
    public_path.write_text(_cert_text(name, public, None))
    return public_path, secret_path


def read_public_key(value: str) -> bytes:
    """A public key from its Z85 text or from a certificate file holding it."""
    if len(value) == Z85_KEY_LEN and not os.path.exists(value):
        return _check_z85(value.encode(), "the public key")
    try:
        public, _ = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a CURVE public key from {value!r}: {e}; give a NAME.key file "
                         "or the key's 40-character Z85 text") from None
    return _check_z85(public, value)


def read_keypair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``NAME.key_secret`` file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a CURVE keypair from {path}: {e}") from None
    if secret is None:
        raise ValueError(f"{path} holds no secret key: give the NAME.key_secret file (`kvpool keygen`)")
    return _check_z85(public, path), _check_z85(secret, path)


def _check_z85(key: bytes, where: str) -> bytes:
    if len(key) != Z85_KEY_LEN:
        raise ValueError(f"{where}: a CURVE key is {Z85_KEY_LEN} Z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError):
        raise ValueError(f"{where}: not a Z85-encoded key") from None
    return key


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key: str | None, key_file: str | None) -> ClientKeys | None:
        """None when neither is given; both are needed otherwise."""
        if not server_key and not key_file:
            return None
        if not server_key or not key_file:
            raise ValueError("CURVE needs both the manager's public key (--curve-server-key / "
                             f"{ENV_SERVER_KEY}) and this client's key file (--curve-key-file / {ENV_KEY_FILE})")
        public, secret = read_keypair(key_file)
        return cls(read_public_key(server_key), public, secret)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientKeys | None:
        env = os.environ if env is None else env
        return cls.load(env.get(ENV_SERVER_KEY) or None, env.get(ENV_KEY_FILE) or None)

    def apply(self, sock: zmq.Socket) -> None:
        """Makes ``sock`` a CURVE client (before connect)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class CurveServer:
    """A ROUTER socket as a CURVE server that lets in only the allowed clients' keys.

    With a secret key file, the socket is a CURVE server, and a ZAP handler (pyzmq's
    ``ThreadAuthenticator``, which runs in its own thread by design and touches no loop state)
    accepts a connection only when the client's public key is one of the ``*.key`` files in
    ``allowed_keys_dir``. A client without CURVE, or with another key, never completes the
    handshake: it gets no reply at all. ``reload`` re-reads the directory (on SIGHUP). The
    manager's control socket and the worker's generate socket both use it.
    """

    def __init__(self, ctx: zmq.Context, secret_key_file: str, allowed_keys_dir: str) -> None:
        self.public, self.secret = read_keypair(secret_key_file)
        self.allowed_dir = allowed_keys_dir
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvpool.zap"))
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
