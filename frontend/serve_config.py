"""`kvpool serve`'s settings, layered as the daemons' are (cli/layered.py): defaults < a TOML file
(a ``[frontdoor]`` table; ``/etc/kvpool/frontdoor.toml`` when it exists) < ``KVPOOL_FRONTDOOR_*``
< options. ``frontdoor_config`` turns them into the running front door's ``FrontDoorConfig``,
reading the CURVE key files, so a bad key is refused at start with what to change.

CURVE: the front door is a client of the managers and of the workers. ``curve_key_file`` is
its own keypair (``kvpool keygen``; its public half goes into the allowed-keys directory of
every manager and worker that runs CURVE), ``curve_server_key`` the managers' public key,
``worker_curve_key`` the workers' (one key for every worker the managers announce).

Managers: one list item (one ``-m``) per manager, a comma list inside it being that manager's
failover endpoints; in ``KVPOOL_FRONTDOOR_MANAGERS``, ``;`` separates managers
(``parse_managers``), since a comma already means failover.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.frontend.http_limits import HTTPLimits
from kvpool.shared.bind import is_loopback_tcp, read_secret_file

POLICIES = ("kv-aware", "round-robin", "least-loaded")


def parse_managers(text: str) -> list[str]:
    """``KVPOOL_FRONTDOOR_MANAGERS`` (or a string for ``managers`` in the file): managers
    separated by ``;``, each one endpoint or one manager's failover endpoints separated by
    commas, as ``-m`` and ``KVPOOL_MANAGER`` take a failover list. A comma with no ``;`` is
    refused: it read as several managers once, and as one manager's failover list for ``-m``,
    so the operator says which (a trailing ``;`` marks one manager's failover list)."""
    if "," in text and ";" not in text:
        raise ValueError(
            f"{text!r} is ambiguous: separate managers with ';' (tcp://node1:5555;tcp://node2:5555); "
            "one manager's failover endpoints take commas and a ';' after them "
            "(tcp://node1:5555,tcp://standby1:5555;)")
    managers = []
    for part in text.split(";"):
        if part.strip():
            managers.append(",".join(ep.strip() for ep in part.split(",")))
    if not managers:
        raise ValueError(f"{text!r} names no manager endpoint")
    return managers


def _check_manager(m: object) -> None:
    """One manager: an endpoint, or its failover endpoints joined by commas (no blanks)."""
    if not isinstance(m, str) or not all(ep and not any(c.isspace() for c in ep) and ";" not in ep
                                        for ep in m.split(",")):
        raise ValueError(f"managers: {m!r} is not an endpoint or a comma list of one manager's failover "
                         "endpoints (one list item per manager; in KVPOOL_FRONTDOOR_MANAGERS, ';' between "
                         "managers)")


@dataclass
class ServeConfig:
    # [the local default manager]; each item one manager ("a,b": its failover endpoints)
    managers: list[str] = field(default_factory=list, metadata={"parse": parse_managers})
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv-aware"
    kv_overlap_weight: float = 2.0
    poll_interval: float = 0.5
    worker_silence: float = 30.0
    manager_grace: float = 5.0  # seconds a manager may fail polls (or workers report it lost) before 503s
    tokenizers: dict = field(default_factory=dict)  # model name -> tokenizer directory
    log_level: str = "warning"
    curve_server_key: str | None = None  # the managers' public key: NAME.key or its Z85 text
    curve_key_file: str | None = None  # this front door's NAME.key_secret
    worker_curve_key: str | None = None  # the workers' public key: NAME.key or its Z85 text
    insecure: bool = False  # connect to non-loopback TCP managers/workers without CURVE
    # API keys (`Authorization: Bearer KEY` under /v1, as `vllm serve --api-key`): one given here
    # (env KVPOOL_API_KEY) and/or one in a file of mode 0600 (its first line; a key on a command
    # line shows in /proc to every local user). A host beyond loopback needs one.
    api_key: str | None = None
    api_key_file: str | None = None
    allow_unauthenticated: bool = False  # listen beyond loopback with no API key (a trusted network only)
    # HTTP bounds (frontend/http_limits.py)
    max_connections: int = 4096
    limit_concurrency: int = 2048
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0

    def __post_init__(self) -> None:
        self.managers = list(self.managers)
        for m in self.managers:
            _check_manager(m)
        self.tokenizers = dict(self.tokenizers)  # the CLI gives (model, path) pairs
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0: any free port), got {self.port}")
        bad = {k: v for k, v in self.tokenizers.items() if not (isinstance(k, str) and isinstance(v, str) and k and v)}
        if bad:
            raise ValueError(f"tokenizers maps model names to tokenizer directories, got {bad}")
        self.http_limits()  # ValueError says which bound is wrong
        if not is_loopback_tcp(f"tcp://{self.host}:0") and not (self.api_key or self.api_key_file or self.allow_unauthenticated):
            raise ValueError(f"host {self.host!r} listens beyond loopback with no API key: set api_key_file "
                             "(--api-key-file) or api_key (--api-key, env KVPOOL_API_KEY), or "
                             "allow_unauthenticated = true (--allow-unauthenticated) on a trusted network")
        if self.curve_key_file and not (self.curve_server_key or self.worker_curve_key):
            raise ValueError("curve_key_file (--curve-key-file) is used with the managers' public key "
                             "(--curve-server-key) or the workers' (--worker-curve-key): give one of them")

    def http_limits(self) -> HTTPLimits:
        return HTTPLimits(self.max_connections, self.limit_concurrency, self.header_timeout, self.body_timeout,
                          self.keep_alive_timeout)

    def api_keys(self) -> list[str]:
        """The keys requests may bear (none: no authentication); the key file is read now, so a
        missing, empty or group-readable one is refused at start."""
        keys = [self.api_key] if self.api_key else []
        if self.api_key_file:
            keys.append(read_secret_file(self.api_key_file, "api_key_file"))
        return keys

    def frontdoor_config(self) -> Any:
        """The FrontDoorConfig these settings describe; ValueError says what to change."""
        from kvpool.frontend.service import FrontDoorConfig
        from kvpool.shared.curve import ClientKeys
        from kvpool.shared.protocol import default_endpoint

        manager_keys = worker_keys = None
        if self.curve_server_key:
            manager_keys = ClientKeys.load(self.curve_server_key, self.curve_key_file)
        if self.worker_curve_key:
            if not self.curve_key_file:
                raise ValueError("CURVE to the workers needs this front door's key file too (--curve-key-file / "
                                 "curve_key_file, a NAME.key_secret from `kvpool keygen`)")
            worker_keys = ClientKeys.load(self.worker_curve_key, self.curve_key_file)
        return FrontDoorConfig(tuple(self.managers or [default_endpoint()]), self.policy, self.kv_overlap_weight,
                               self.poll_interval, self.worker_silence, tuple(self.tokenizers.items()),
                               manager_keys=manager_keys, worker_keys=worker_keys, insecure=self.insecure,
                               manager_grace_s=self.manager_grace)
