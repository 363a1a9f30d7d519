"""The manager wire contract: framing, envelopes, limits, error codes, argument validation.

PROTOCOL.md sections 2-7 are the normative text; this module is its one implementation.

Transport: ZeroMQ. The manager binds a ROUTER socket; clients connect DEALER sockets (a REQ
socket also works). Frames as the manager sees them::

    [routing-id, payload]          a DEALER sends exactly one frame: the payload
    [routing-id, b"", payload]     a REQ socket (or a DEALER mimicking one) adds an empty delimiter

The reply mirrors the request's framing. ``payload`` is one msgpack map (str keys, bytes as
msgpack bin, strings as msgpack str)::

    request {"v": 1, "id": uint64, "op": str, "sid": str (every op but hello), "args": map,
             "seq": uint64 (optional: the highest commit sequence the client saw)}
    reply   {"id": uint64 | nil, "status": "ok" | <error code>, "inc": str, "state": str (optional),
             "seq": uint64 (durable managers), "body": map (ok, and some errors), "msg": str (errors only)}

``inc`` is the manager process's incarnation id; ``state`` the id of the state it serves (absent:
equal to ``inc``). When the state id changes, every session, registration and request the client
knew is gone. Without persistence the two are equal (a new process, a new empty state); with a
persistent store the state id survives restarts and failovers, so clients carry on. ``seq``, the
state's commit sequence, never goes down within one state id: a client that meets a lower one
treats it as a new state (PROTOCOL.md section 11). Never pickle, never msgpack ext types.
"""

from __future__ import annotations

import os
import re
import reprlib
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool.shared.bounded import (
    DuplicateKey as DuplicateKey,  # re-exported: callers catch them here
)
from kvpool.shared.bounded import TooComplex as TooComplex
from kvpool.shared.bounded import check_envelope_keys, unpack_counted
from kvpool.shared.hashing import HASH_BYTES

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_MESSAGE_BYTES = 8 << 20  # a larger request gets "too_large"
MAX_SUB_OPS = 1024  # sub-ops in one step message
MAX_MODEL_LEN = 1 << 24  # the most tokens per request any spec may declare (a manager's own bound is lower)
MAX_HASHES = 1 << 17  # hashes in one lookup/locate, or one sub-op (2M tokens at block_size 16)
HOST_POLICIES = ("demote", "write_through")  # register.host_kv_policy: when blocks reach the host tier
ROLES = ("worker", "admin", "router", "observer")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}\Z")

# Error codes of whole messages (sub-op codes are listed in manager/core/step.py and PROTOCOL.md).
ERROR_CODES = {
    "bad_message": "not msgpack, not a map, or a bad envelope field (v, id, op, sid, args)",
    "too_large": "the payload exceeds max_message_bytes",
    "unsupported_version": "no protocol version in common; body.versions lists the manager's",
    "unknown_op": "the op is not in the dispatch table",
    "bad_field": "an argument is missing, of the wrong type or out of range",
    "bad_hash": "a block hash is not a 32-byte bin",
    "unknown_session": "sid unknown or expired: hello again (requests of the old session are gone)",
    "forbidden": "an admin op or role without the configured admin key",
    "too_many_sessions": "the manager's session limit is reached",
    "too_many_pools": "the manager's pool limit is reached",
    "unknown_pool": "no pool of that name",
    "pool_not_ready": "not every shard of the pool has registered yet",
    "stale_epoch": "the pool restarted since the client learned its epoch; body.epoch is current",
    "spec_mismatch": "a shard's KV spec or shard_count disagrees with the pool's",
    "shard_conflict": "the same shard incarnation registered again with a different spec or size",
    "insufficient_memory": "the KV bytes hold fewer than 2 blocks",
    "too_many_sub_ops": "a step carries more than max_sub_ops sub-ops",
    "in_use": "reset refused: blocks of the pool are in use",
    "invariant_broken": "the check op found a broken pool invariant (a manager bug)",
    "store_unavailable": "the state store (Redis) failed: nothing of this message was acknowledged; retry "
                         "(a step with the same id)",
    "not_active": "this manager is a standby, or lost its lease: try the next endpoint",
    "stale_request": "a step id older than the session's last step: a late duplicate, not run",
    "not_owner": "the pool (or the shard) belongs to other live sessions: only they or an admin may step on it "
                 "or register over it (register with replace: true takes a shard over)",
    "quota_exceeded": "the registration would take the session or the manager past its block quota",
    "step_too_large": "a step would hand out or share more than max_step_blocks blocks: split it",
    "name_taken": "attach: the name is a kvpool pool's or another external pool's (or its topic is taken)",
    "pin_refused": "a pin would hold more than the pinned share of a tier; the message gives the figures",
    "internal": "a manager bug; the message was logged",
}


class ManagerError(Exception):
    """An error reply (client side) or the error a handler raises (manager side)."""

    def __init__(self, code: str, message: str, body: dict | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.body = body or {}


class ManagerUnavailable(ManagerError):
    """No reply within the timeout (manager down, unreachable or overloaded)."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


class StaleEpoch(ManagerError):
    """The pool's epoch moved on: its requests are gone; register again to learn ``epoch``."""

    @property
    def epoch(self) -> int | None:
        return self.body.get("epoch")


class ManagerRestarted(ManagerError):
    """The manager's incarnation changed: sessions, registrations and requests are gone.

    The client has already dropped its session; the caller aborts its running requests and
    registers again (``hello`` happens automatically on the next call).
    """

    def __init__(self, old: str | None, new: str | None, message: str = "") -> None:
        super().__init__("manager_restarted", message or f"manager incarnation {old} -> {new}")
        self.old, self.new = old, new


class SessionExpired(ManagerRestarted):
    """The manager timed this session out (silent past session_timeout): its requests are freed."""

    def __init__(self, incarnation: str | None, message: str = "") -> None:
        ManagerError.__init__(self, "session_expired", message or "the manager expired this session")
        self.old = self.new = incarnation


# -- codec ---------------------------------------------------------------------------------


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# Every byte that cannot be a map or array header (fixmap, fixarray, map16/32, array16/32).
_NOT_CONTAINER_HEADERS = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF))


def max_containers(max_sub_ops: int = MAX_SUB_OPS) -> int:
    """Maps and arrays a request may hold: a step's envelope, args and ops list, and per sub-op
    its map and its hash list, with room to spare."""
    return 4 * max_sub_ops + 256


def unpack(payload: bytes, max_objects: int | None = None) -> Any:
    """Decodes one payload; raises (ValueError and friends) on anything that is not msgpack.

    With ``max_objects``, decoding is bounded the way a request is: no array longer than
    twice ``MAX_HASHES`` (a longer list is refused by its field's check), no map of more than 64 keys, no ext types, and at most ``max_objects``
    maps and arrays in all, counted as they are built, so a payload of millions of empty maps
    is refused after building a few thousand (``TooComplex``), not after building them all.
    A message map that repeats a key (``{"op": "heartbeat", "op": "stats"}``) is refused
    (``DuplicateKey``) rather than read as its last value.
    """
    if max_objects is None:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if len(payload.translate(None, _NOT_CONTAINER_HEADERS)) <= max_objects:
        # Fewer bytes that could start a map or an array than the limit: nothing to count.
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_array_len=2 * MAX_HASHES,
                              max_map_len=64, max_ext_len=0)
    else:
        msg = unpack_counted(payload, max_objects, f"more than {max_objects} maps and arrays in one message (the limit)",
                             max_array_len=2 * MAX_HASHES, max_map_len=64, max_ext_len=0)
    check_envelope_keys(payload, msg)
    return msg


def encode_request(msg_id: int, op: str, sid: str | None, args: dict, seq: int | None = None) -> bytes:
    """``seq``: the highest commit sequence the client saw in its session's state (optional)."""
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": msg_id, "op": op, "args": args}
    if sid is not None:
        msg["sid"] = sid
        if seq:
            msg["seq"] = seq
    return pack(msg)


def ok_reply(msg_id: int | None, inc: str, body: dict, state: str | None = None, seq: int | None = None) -> bytes:
    reply: dict[str, Any] = {"id": msg_id, "status": "ok", "inc": inc, "body": body}
    if state is not None and state != inc:
        reply["state"] = state
    if seq is not None:
        reply["seq"] = seq
    return pack(reply)


def error_reply(msg_id: int | None, inc: str, err: ManagerError, state: str | None = None,
                seq: int | None = None) -> bytes:
    reply: dict[str, Any] = {"id": msg_id, "status": err.code, "inc": inc, "msg": err.message}
    if state is not None and state != inc:
        reply["state"] = state
    if seq is not None:
        reply["seq"] = seq
    if err.body:
        reply["body"] = err.body
    return pack(reply)


def raise_for_reply(reply: dict) -> dict:
    """The reply's body, or the matching ManagerError subclass raised."""
    status = reply.get("status")
    if status == "ok":
        body = reply.get("body")
        return body if isinstance(body, dict) else {}
    code = status if isinstance(status, str) else "bad_message"
    msg = reply.get("msg") if isinstance(reply.get("msg"), str) else ""
    body = reply.get("body") if isinstance(reply.get("body"), dict) else None
    cls = StaleEpoch if code == "stale_epoch" else ManagerError
    raise cls(code, msg, body)


# -- endpoints -----------------------------------------------------------------------------


def default_endpoint() -> str:
    """ipc://$XDG_RUNTIME_DIR/kvpool/manager.sock, else ipc:///tmp/kvpool-$UID/manager.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvpool") if runtime else f"/tmp/kvpool-{os.getuid()}"
    return f"ipc://{os.path.join(base, 'manager.sock')}"


# -- argument validation (the manager's boundary) ------------------------------------------

_MISSING: Any = object()


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 40, 40


def short_repr(value: Any, limit: int = 60) -> str:
    """A client's value for an error message: bounded in depth and length (a value nested a
    thousand levels deep must not recurse, nor a huge one fill the reply)."""
    return _SHORT.repr(value)[:limit]


def bad_field(key: str, want: str, got: Any) -> ManagerError:
    return ManagerError("bad_field", f"field {key!r} must be {want}, got {short_repr(got)}")


def get_int(args: dict, key: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    """An int in ``[lo, hi]`` (bools and floats are refused)."""
    v = args.get(key, default)
    if type(v) is not int or not lo <= v <= hi:
        if v is _MISSING:
            v = "nothing"
        raise bad_field(key, f"an int in [{lo}, {hi}]", v)
    return v


def get_str(args: dict, key: str, max_len: int, default: Any = _MISSING, pattern: re.Pattern | None = None) -> str:
    v = args.get(key, default)
    if type(v) is not str or not 0 < len(v) <= max_len or (pattern and not pattern.match(v)):
        if v is _MISSING:
            v = "nothing"
        want = f"a str of 1-{max_len} chars" + (f" matching {pattern.pattern}" if pattern else "")
        raise bad_field(key, want, v)
    return v


def check_serve(v: Any) -> dict:
    """``register.args.serve``: where a worker serves generate requests (PROTOCOL.md section 5)."""
    if type(v) is not dict:
        raise bad_field("serve", "a map {endpoint, model, max_model_len}", v)
    endpoint, model, max_len = v.get("endpoint"), v.get("model"), v.get("max_model_len")
    if type(endpoint) is not str or not 0 < len(endpoint) <= 512 or not endpoint.startswith(("ipc://", "tcp://")):
        raise bad_field("serve.endpoint", "an ipc:// or tcp:// address of at most 512 characters", endpoint)
    if type(model) is not str or not 0 < len(model) <= 512:
        raise bad_field("serve.model", "a model name of 1-512 characters", model)
    if type(max_len) is not int or not 1 < max_len <= 1 << 24:
        raise bad_field("serve.max_model_len", "an int in [2, 2^24]", max_len)
    out = {"endpoint": endpoint, "model": model, "max_model_len": max_len}
    tokenizer = v.get("tokenizer")
    if tokenizer is not None:
        if type(tokenizer) is not str or not 0 < len(tokenizer) <= 4096:
            raise bad_field("serve.tokenizer", "a tokenizer path of 1-4096 characters", tokenizer)
        out["tokenizer"] = tokenizer
    return out


def get_map(args: dict, key: str) -> dict:
    v = args.get(key)
    if type(v) is not dict:
        raise bad_field(key, "a map", v)
    return v


def get_hashes(args: dict, key: str = "hashes") -> list[bytes]:
    hs = args.get(key)
    if type(hs) is not list or len(hs) > MAX_HASHES:
        raise bad_field(key, f"a list of at most {MAX_HASHES} {HASH_BYTES}-byte bins", hs)
    for h in hs:
        if type(h) is not bytes or len(h) != HASH_BYTES:
            raise ManagerError("bad_hash", f"every hash must be a {HASH_BYTES}-byte bin, got {short_repr(h, 40)}")
    return hs


_SPEC_LIMITS = {"block_size": 1 << 16, "num_layers": 1 << 12, "num_kv_heads": 1 << 12, "head_size": 1 << 12}


@dataclass(frozen=True)
class KVSpec:
    """The KV-cache layout of one shard: what a worker registers and the manager sizes blocks by.

    Validated here and nowhere else (``bad_field`` naming the field); on the wire it is the map
    ``{block_size, num_layers, num_kv_heads, head_size, dtype}`` (``to_wire`` / ``from_wire``).
    ``num_kv_heads`` is this shard's share of the model's heads.
    """

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str  # a key of DTYPE_BYTES
    # The most tokens one request of this shard's engine holds, when it declares it; the manager
    # bounds each sub-op's tokens by the least its shards declare (manager/guards.py).
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for key, hi in _SPEC_LIMITS.items():
            get_int(vars(self), key, 1, hi)
        if type(self.dtype) is not str or self.dtype not in DTYPE_BYTES:  # a list would be unhashable
            raise bad_field("dtype", f"one of {sorted(DTYPE_BYTES)}", self.dtype)
        if self.max_model_len is not None:
            get_int(vars(self), "max_model_len", 1, MAX_MODEL_LEN)

    @classmethod
    def from_wire(cls, spec: object) -> KVSpec:
        """The spec a wire map describes (other keys are ignored); ``bad_field`` otherwise."""
        if type(spec) is not dict:
            raise bad_field("spec", "a map", spec)
        return cls(*(spec.get(key, _MISSING) for key in _SPEC_LIMITS), spec.get("dtype"),  # type: ignore[arg-type]
                   spec.get("max_model_len"))

    def to_wire(self) -> dict:
        out = {"block_size": self.block_size, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
               "head_size": self.head_size, "dtype": self.dtype}
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        return out

    @property
    def block_bytes(self) -> int:
        """KV bytes one block takes on one shard, over all layers (K and V)."""
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]
        return per_layer * self.num_layers
