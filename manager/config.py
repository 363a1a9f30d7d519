"""Manager daemon configuration: one dataclass, validated in ``__post_init__``.

Sources, later ones winning: defaults, a config file (``.toml`` on Python 3.11+, or ``.json``),
command-line options. Only entry points see this object; inner classes take explicit scalars.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields

from kvpool.shared.protocol import MAX_MESSAGE_BYTES, MAX_SUB_OPS, default_endpoint

_IPC_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included
_TCP = re.compile(r"tcp://.+:(\*|[1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5])\Z")


@dataclass
class ManagerConfig:
    endpoint: str = field(default_factory=default_endpoint)
    session_timeout_s: float = 10.0  # a session silent this long is dead; its requests are freed
    admin_key: str | None = None  # when set, admin ops need a hello with role "admin" and this key
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_sub_ops: int = MAX_SUB_OPS
    max_sessions: int = 4096
    max_pools: int = 256
    max_blocks: int = 1 << 22  # per pool; a shard reporting more KV memory is clamped to this
    max_batch: int = 4096  # messages handled per loop iteration (bounds reply latency under flood)
    send_hwm: int = 1000  # replies queued per client; a client that does not read loses replies

    def __post_init__(self) -> None:
        ep = self.endpoint
        if not ep.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {ep!r}")
        if ep.startswith("tcp://") and not _TCP.match(ep):
            raise ValueError(f"tcp endpoint must be tcp://HOST:PORT with PORT in 1..65535 (or *), got {ep!r}")
        if ep.startswith("ipc://") and len(ep) - len("ipc://") > _IPC_PATH_MAX:
            raise ValueError(
                f"ipc socket path is {len(ep) - 6} bytes, the limit is {_IPC_PATH_MAX}: "
                "use a shorter path (XDG_RUNTIME_DIR) or a tcp:// endpoint"
            )
        if not 0.05 <= self.session_timeout_s <= 86400:
            raise ValueError(f"session_timeout_s must be in [0.05, 86400] seconds, got {self.session_timeout_s}")
        if self.admin_key is not None and len(self.admin_key) < 8:
            raise ValueError("admin_key must be at least 8 characters (or unset to allow every client)")
        for name, lo in (("max_message_bytes", 1024), ("max_sub_ops", 1), ("max_sessions", 1),
                         ("max_pools", 1), ("max_blocks", 2), ("max_batch", 1), ("send_hwm", 1)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")

    @property
    def ipc_path(self) -> str | None:
        return self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None

    @classmethod
    def from_file(cls, path: str, **overrides: object) -> ManagerConfig:
        """Reads a .toml or .json file; ``overrides`` (not None) win over the file."""
        values = _read(path)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known keys: {sorted(known)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _read(path: str) -> dict:
    if not os.path.exists(path):
        raise ValueError(f"config file {path} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".json"):
        values = json.loads(data)
    elif path.endswith(".toml"):
        try:
            import tomllib
        except ImportError as e:  # Python 3.10
            raise ValueError(f"{path}: TOML needs Python 3.11+; use a .json config file") from e
        values = tomllib.loads(data.decode())
        values = values.get("manager", values)  # either a [manager] table or top-level keys
    else:
        raise ValueError(f"config file {path} must end in .toml or .json")
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the top level must be a table/object")
    return values
