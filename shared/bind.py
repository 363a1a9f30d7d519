"""Where a kvpool process may bind a socket: checks shared by the manager and the worker.

- ``runtime_dir()``: the per-user directory of default ipc sockets (and the manager's
  high-water mark file): ``$XDG_RUNTIME_DIR/kvpool``, else ``/tmp/kvpool-$UID``.
- ``check_private_dir(path)``: a directory that holds a socket must belong to this user and
  be writable by nobody else. Otherwise another local user could have created it first, put
  their own socket at the path, and read what clients send (admin keys included).
- ``check_bind(endpoint, curve, insecure)``: a TCP endpoint on an address other than loopback
  must use CURVE, unless the operator says ``--insecure`` (a trusted, isolated network).
- ``check_connect(endpoint, curve, insecure)``: the same rule for a client's connection (the
  front door's to managers and workers): what it sends would cross the network in clear text.

- ``read_secret_file(path)``: a key kept in a file of mode 0600 (never on a command line, where
  ``/proc/PID/cmdline`` shows it to every local user).

Every refusal raises ``BindRefused`` (a ValueError) saying what to change.
"""

from __future__ import annotations

import ipaddress
import os
import stat

LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


class BindRefused(ValueError):
    """A socket kvpool will not bind as configured; the message says what to change."""


def runtime_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "kvpool") if runtime else f"/tmp/kvpool-{os.getuid()}"


def check_private_dir(path: str) -> None:
    """Raises BindRefused unless ``path`` is a directory (not a link) owned by this user
    with no group or other write permission."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BindRefused(f"socket directory {path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BindRefused(f"socket directory {path} is not a directory (a link or a file): remove it, or "
                          "choose another endpoint")
    if st.st_uid != os.getuid():
        raise BindRefused(f"socket directory {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                          "another user may control it; remove it, or set XDG_RUNTIME_DIR or the endpoint to a "
                          "directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BindRefused(f"socket directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                          f"`chmod go-w {path}` (or 0700), or choose another directory")


def ensure_private_dir(path: str) -> None:
    """Creates ``path`` (mode 0700) when missing, then checks it as ``check_private_dir``."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private_dir(path)


def is_loopback_tcp(endpoint: str) -> bool:
    """True for tcp://127.x.y.z:P, tcp://[::1]:P, tcp://localhost:P (and non-TCP endpoints)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    if ";" in host:  # zmq's tcp://SOURCE;DEST form: what is bound is the address after ';'
        host = host.rpartition(";")[2]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: may be reachable from outside


def check_bind(endpoint: str, *, curve: bool, insecure: bool, what: str = "endpoint") -> None:
    """Refuses to bind a non-loopback TCP ``endpoint`` without CURVE unless ``insecure``."""
    if curve or insecure or is_loopback_tcp(endpoint):
        return
    raise BindRefused(f"{what} {endpoint} is reachable from other hosts without CURVE: anyone there could "
                      "connect. Configure CURVE keys (`kvpool keygen`; curve_secret_key_file and "
                      "curve_allowed_keys_dir), bind 127.0.0.1, or pass --insecure on a trusted network")


def check_connect(endpoint: str, *, curve: bool, insecure: bool, what: str = "endpoint") -> None:
    """Refuses to connect to a non-loopback TCP ``endpoint`` without CURVE unless ``insecure``."""
    if curve or insecure or is_loopback_tcp(endpoint):
        return
    raise BindRefused(f"{what} {endpoint} is on the network and CURVE is off: requests (and admin keys) would "
                      "cross it in clear text. Give this client's CURVE keys (the server's public key and "
                      "--curve-key-file), or pass --insecure on a trusted network")


def check_curve_files(key: str | None, allowed: str | None, *, needs_both: str) -> None:
    """A CURVE server's files (curve_secret_key_file, curve_allowed_keys_dir): both or neither,
    and both present. ``needs_both``: the message when only one is set, naming whose files."""
    if bool(key) != bool(allowed):
        raise ValueError(needs_both)
    if key and not os.path.isfile(key):
        raise ValueError(f"curve_secret_key_file {key} does not exist; create it with `kvpool keygen`")
    if allowed and not os.path.isdir(allowed):
        raise ValueError(f"curve_allowed_keys_dir {allowed} is not a directory")


def read_secret_file(path: str, what: str) -> str:
    """A secret (an admin key) from a file that only its owner may read: its first line."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as fh:
            text = fh.readline().strip()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                         f"`chmod 600 {path}`")
    if not text:
        raise ValueError(f"{what} {path} is empty: put the key on its first line")
    return text
