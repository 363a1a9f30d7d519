"""Manager daemon configuration: one dataclass, validated in ``__post_init__``.

Sources, later ones winning (shared/config.py): defaults, a config file (``.toml`` with a
``[manager]`` table, or ``.json``), ``KVPOOL_MANAGER_<FIELD>`` environment variables, command-line
options. Only entry points see this object; inner classes take explicit scalars.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.events import check_format
from kvpool.manager.node_tiers import NodeTierSettings
from kvpool.shared.bind import check_bind, check_curve_files, read_secret_file
from kvpool.shared.config import BYTES
from kvpool.shared.logs import check_level
from kvpool.shared.protocol import (
    MAX_MESSAGE_BYTES,
    MAX_MODEL_LEN,
    MAX_SUB_OPS,
    ManagerError,
    default_endpoint,
)

_IPC_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included
_TCP = re.compile(r"tcp://.+:(\*|[1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5])\Z")


@dataclass
class ManagerConfig:
    endpoint: str = field(default_factory=default_endpoint)
    session_timeout_s: float = 10.0  # a session silent this long is dead; its requests are freed
    admin_key: str | None = None  # when set, admin ops need a hello with role "admin" and this key
    admin_key_file: str | None = None  # the admin key read from this file (kept out of argv and env)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_sub_ops: int = MAX_SUB_OPS
    max_sessions: int = 4096
    max_pools: int = 256
    max_blocks: int = 1 << 22  # per pool; a shard reporting more KV memory is clamped to this
    max_batch: int = 4096  # messages handled per loop iteration (bounds reply latency under flood)
    # an iteration stops reading once its messages took this long to handle (0: only max_batch
    # bounds it): ZeroMQ reads the clients in turn, so a client behind a flood waits for about
    # one such slice and its commit, not for max_batch flooded messages
    max_batch_ms: float = 5.0
    max_step_blocks: int = 1 << 16  # blocks one step may hand out or share (bounds a message's work)
    max_session_blocks: int = 1 << 23  # blocks of the shards one session may register, all pools
    max_total_blocks: int = 1 << 26  # blocks of every pool together (the manager's memory is per block)
    max_model_len: int = 1 << 20  # tokens per request when a pool declares none; the most one may declare
    send_hwm: int = 1000  # replies queued per client; a client that does not read loses replies
    # after a busy iteration the loop polls without sleeping this long, so a steady stream of steps
    # never pays a wakeup; adaptive, off while the cores are contended (manager/busy_poll.py); 0: off
    busy_poll_us: int = 2000
    # -- operating (docs/operating.md) --
    metrics_port: int = 0  # Prometheus /metrics on this TCP port; 0: off (the packaged config: 9400)
    metrics_host: str = "127.0.0.1"  # address the metrics endpoint binds (0.0.0.0: every interface)
    events_endpoint: str | None = None  # KV events PUB socket (vLLM wire format), e.g. tcp://*:5557
    events_replay_endpoint: str | None = None  # replay ROUTER for missed event batches
    # the SUB socket attached vLLM servers publish their KV events to (kvpool attach): vLLM's
    # publisher connects to a plain tcp://HOST:PORT, so the manager binds it; e.g. tcp://127.0.0.1:5570
    vllm_events_endpoint: str | None = None
    # vLLM servers attached at start, as `kvpool attach` would: [[manager.attach]] tables with
    # name, url, model, block_size, topic and optional replay, events
    attach: list = field(default_factory=list)
    # each attached server's /metrics is read this often (its load; 0: never), and a server that
    # computes whole blocks with no KV-event batch within vllm_events_window_s is marked stale
    # (manager/external/silence.py)
    vllm_metrics_poll_s: float = 1.0
    vllm_events_window_s: float = 10.0
    events_buffer: int = 10_000  # event batches kept for replay
    events_format: str = "vllm-0.33"  # vllm-0.33 (tagged maps) or vllm-0.11 (arrays): manager/events.py
    curve_secret_key_file: str | None = None  # the manager's NAME.key_secret: CURVE on the control socket
    curve_allowed_keys_dir: str | None = None  # one NAME.key per allowed client (SIGHUP reloads it)
    insecure: bool = False  # allow binding a non-loopback TCP address without CURVE (trusted networks only)
    json_logs: bool = False  # one JSON object per log line
    log_level: str = "info"
    # -- durability (manager/store/redis_store.py; PROTOCOL.md section 11) --
    redis_url: str | None = None  # persist state in Redis (redis://, redis+sentinel://, redis+cluster://)
    namespace: str = "default"  # the Redis key namespace: one state, one active manager
    durability: str = "sync"  # sync: commit before replying; async: reply first (a crash may lose acks)
    lease_ms: int = 3000  # the active manager's lease; a standby takes over this long after it dies
    snapshot_bytes: int = 32 << 20  # journal bytes that trigger a snapshot (and a journal trim)
    redis_timeout_s: float = 2.0  # a Redis call slower than this counts as Redis unavailable
    redis_min_replicas: int = 0  # replicas that confirm each commit (WAIT) before it is acknowledged
    # the highest commit this host acknowledged (manager/store/high_water.py); default:
    # RUNTIME_DIR/NAMESPACE.seq. On persistent storage it also catches a rolled-back Redis after a reboot.
    high_water_file: str | None = None
    # -- the node tier (manager/node_tiers.py; docs/operating.md "Sizing the node tier") --
    # host memory of each KV layout's node tier, shared by every pool of the layout (0: none)
    node_tier_memory: int = field(default=0, metadata=BYTES)
    node_tier_dir: str = "/dev/shm"  # where the host level's shared-memory files are
    node_tier_disk: str | None = None  # the disk level's directory (none: no disk level)
    node_tier_disk_size: int = field(default=0, metadata=BYTES)  # the disk level's bytes, per layout
    node_tier_policy: str = "demote"  # demote, write_through or write_through_selective (host -> disk)
    node_tier_admit_hits: int | None = None  # hits before a block is written down (None: the policy's default)
    node_tier_pin_share: float = 0.25  # at most this share of a level's blocks may be pinned
    node_tier_max_layouts: int = 4  # layouts that get a node tier (each takes node_tier_memory)

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
        if self.admin_key_file:
            self.admin_key = read_secret_file(self.admin_key_file, "admin_key_file")
        if self.admin_key is not None and len(self.admin_key) < 8:
            raise ValueError("admin_key must be at least 8 characters (or unset to allow every client)")
        for name, lo in (("max_message_bytes", 1024), ("max_sub_ops", 1), ("max_sessions", 1),
                         ("max_pools", 1), ("max_blocks", 2), ("max_batch", 1), ("send_hwm", 1),
                         ("max_step_blocks", 1), ("max_session_blocks", 2), ("max_total_blocks", 2),
                         ("max_model_len", 1),
                         ("events_buffer", 1)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if self.max_model_len > MAX_MODEL_LEN:
            raise ValueError(f"max_model_len must be at most {MAX_MODEL_LEN}, got {self.max_model_len}")
        if type(self.max_batch_ms) not in (int, float) or not 0 <= self.max_batch_ms <= 10_000:
            raise ValueError(f"max_batch_ms must be a number in [0, 10000] milliseconds (0: off), got {self.max_batch_ms!r}")
        if type(self.busy_poll_us) is not int or not 0 <= self.busy_poll_us <= 100_000:
            raise ValueError(f"busy_poll_us must be an int in [0, 100000] microseconds (0: off), got {self.busy_poll_us!r}")
        self._check_ops()
        self._check_durability()
        self._check_node_tier()

    def _check_node_tier(self) -> None:
        for name in ("node_tier_memory", "node_tier_disk_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"{name} must be a size in bytes >= 0 (e.g. 4GiB), got {v!r}")
        disk, size = self.node_tier_disk, self.node_tier_disk_size
        if (disk is None) != (size == 0):
            raise ValueError("the node tier's disk level needs both node_tier_disk (a directory) and "
                             f"node_tier_disk_size (its byte budget, e.g. 64GiB); got {disk!r} and {size}")
        if disk is not None and not self.node_tier_memory:
            raise ValueError("node_tier_disk needs node_tier_memory: the disk level sits behind the node tier's "
                             "host level (e.g. --node-tier-memory 4GiB)")
        if type(self.node_tier_max_layouts) is not int or self.node_tier_max_layouts < 1:
            raise ValueError(f"node_tier_max_layouts must be an int >= 1, got {self.node_tier_max_layouts!r}")
        try:  # the tier's own checks of policy, admission and pinned share
            NodeTier(2, 2 if disk else 0, 1, 1, policy=self.node_tier_policy, admit_hits=self.node_tier_admit_hits,
                     pin_share=self.node_tier_pin_share)
        except (TypeError, ValueError) as e:
            raise ValueError(f"node tier: {e}") from None
        if not self.node_tier_memory:
            return
        if self.redis_url is not None:
            # A snapshot does not carry the tier's index yet, and a recovery that replays a step
            # against another index than the live one would admit other prefixes: refused, not
            # half-durable (the journal alone would replay it exactly).
            raise ValueError("the node tier is not persisted in Redis yet: run the manager with node_tier_memory "
                             "or with redis_url, not both")
        if not os.path.isdir(self.node_tier_dir) or not os.access(self.node_tier_dir, os.W_OK):
            raise ValueError(f"node_tier_dir {self.node_tier_dir!r} must be a directory this user can write "
                             "(the host level's shared-memory files: /dev/shm, or a tmpfs mount)")
        if disk is not None:
            try:
                os.makedirs(disk, mode=0o700, exist_ok=True)
            except OSError as e:
                raise ValueError(f"node_tier_disk {disk!r} cannot be created: {e}") from None
            if not os.access(disk, os.W_OK):
                raise ValueError(f"node_tier_disk {disk!r} must be writable by this user")

    def node_tier_settings(self) -> NodeTierSettings | None:
        """The node tier's settings (manager/node_tiers.py), or None when it is off."""
        if not self.node_tier_memory:
            return None
        return NodeTierSettings(self.node_tier_memory, self.node_tier_dir, self.node_tier_disk,
                                self.node_tier_disk_size, self.node_tier_policy, self.node_tier_admit_hits,
                                self.node_tier_pin_share, self.node_tier_max_layouts)

    def _check_durability(self) -> None:
        if self.redis_url is not None:
            from kvpool.manager.store.redis_url import parse_redis_url

            parse_redis_url(self.redis_url)
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", self.namespace or ""):
            raise ValueError(f"namespace must be 1-64 of [A-Za-z0-9._:-] (no braces: it is the key hash tag), "
                             f"got {self.namespace!r}")
        if self.durability not in ("sync", "async"):
            raise ValueError(f"durability must be 'sync' or 'async', got {self.durability!r}")
        if type(self.lease_ms) is not int or not 200 <= self.lease_ms <= 600_000:
            raise ValueError(f"lease_ms must be an int in [200, 600000], got {self.lease_ms!r}")
        if self.lease_ms < 1000 * self.redis_timeout_s:
            raise ValueError(f"lease_ms {self.lease_ms} must exceed redis_timeout_s ({self.redis_timeout_s}s), or a "
                             "slow commit outlives the lease: raise lease_ms or lower redis_timeout_s")
        if type(self.snapshot_bytes) is not int or self.snapshot_bytes < 1024:
            raise ValueError(f"snapshot_bytes must be an int >= 1024, got {self.snapshot_bytes!r}")
        if type(self.redis_min_replicas) is not int or not 0 <= self.redis_min_replicas <= 16:
            raise ValueError(f"redis_min_replicas must be an int in [0, 16], got {self.redis_min_replicas!r}")
        if self.redis_min_replicas and (self.redis_url or "").startswith("redis+cluster"):
            raise ValueError("redis_min_replicas needs a standalone or Sentinel Redis (a cluster keeps the state "
                             "on one master; use 0)")
        if not 0.05 <= self.redis_timeout_s <= 60:
            raise ValueError(f"redis_timeout_s must be in [0.05, 60], got {self.redis_timeout_s}")

    def _check_ops(self) -> None:
        if type(self.metrics_port) is not int or not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port in 1..65535, or 0 for no metrics; got {self.metrics_port!r}")
        for name in ("events_endpoint", "events_replay_endpoint", "vllm_events_endpoint"):
            ep = getattr(self, name)
            if ep is not None and not ep.startswith(("ipc://", "tcp://")):
                raise ValueError(f"{name} must be ipc://PATH or tcp://HOST:PORT, got {ep!r}")
        if self.events_replay_endpoint and not self.events_endpoint:
            raise ValueError("events_replay_endpoint needs events_endpoint: set both, or neither")
        check_format(self.events_format)
        if not 0 <= self.vllm_metrics_poll_s <= 3600:
            raise ValueError(f"vllm_metrics_poll_s must be in [0, 3600] seconds (0: never), got {self.vllm_metrics_poll_s!r}")
        if not 0 < self.vllm_events_window_s <= 3600:
            raise ValueError(f"vllm_events_window_s must be in (0, 3600] seconds, got {self.vllm_events_window_s!r}")
        from kvpool.manager.external.ops import (
            attachment,  # (imports the ops table: not at module load)
        )

        for i, entry in enumerate(self.attach):
            if type(entry) is not dict:
                raise ValueError(f"attach[{i}] must be a table (name, url, model, block_size, topic, replay), "
                                 f"got {entry!r:.80}")
            try:
                attachment(entry)
            except ManagerError as e:
                raise ValueError(f"attach[{i}]: {e.message}") from None
        key = self.curve_secret_key_file
        check_curve_files(key, self.curve_allowed_keys_dir, needs_both=(
            "CURVE needs both curve_secret_key_file (the manager's NAME.key_secret) and "
            "curve_allowed_keys_dir (a directory of allowed clients' NAME.key files)"))
        self.log_level = check_level(self.log_level)
        curve = bool(key)
        check_bind(self.endpoint, curve=curve, insecure=self.insecure, what="endpoint")
        for name in ("events_endpoint", "events_replay_endpoint", "vllm_events_endpoint"):  # no CURVE on these
            if getattr(self, name):
                check_bind(getattr(self, name), curve=False, insecure=self.insecure, what=name)

    @property
    def ipc_path(self) -> str | None:
        return self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None

    @classmethod
    def from_file(cls, path: str, **overrides: object) -> ManagerConfig:
        """Reads a .toml ([manager] table) or .json file; ``overrides`` (not None) win over it.
        The environment is not read (``kvpool manager`` layers it in through shared/config.py)."""
        from kvpool.shared.config import load

        return load(cls, "manager", path, env={}, overrides=overrides)[0]
