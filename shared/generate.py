"""The generate protocol's messages (PROTOCOL.md section 12) as records, and their one codec.

Client -> worker: ``GenerateRequest`` (``op: generate``) and ``Control`` (``abort``, ``stats``,
``ping``). Worker -> client: ``TokenMessage`` (one sampled token, or a sample's end),
``ErrorMessage`` (a refused request or a bad message), ``Heartbeat`` (alive, and why nothing
moves), ``StatsReply`` and ``Pong``. Each record has one ``to_wire`` (the msgpack map) and one
``from_wire``; ``parse_reply`` turns any worker message into its record.

The worker reads what anyone may send: a payload is decoded with msgpack's Unpacker limits (no
array or map longer than a real message needs, no ext types) and at most ``MAX_CONTAINERS``
maps and arrays, counted as they are built (no bomb of empty maps, no deep nesting); a generate
message becomes a ``GenerateRequest`` only through ``GenerateRequest.from_wire``, whose params
are a checked ``SamplingParams`` (shared/sampling.py). ``Engine.add_request`` checks the prompt
against the model. Every failure is a ValueError whose text goes back to the client.

A client may send the caller's params map unchecked (``params`` a dict): the worker's refusal,
with its text, is then what the caller reads, as the protocol promises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool.shared.bounded import unpack_counted
from kvpool.shared.sampling import TEXT_ONLY, SamplingParams

MAX_MESSAGE_BYTES = 4 << 20
MAX_PROMPT_TOKENS = 1 << 20  # longer than any max_model_len we accept; the engine checks the real one
MAX_ID_LEN = 128
MAX_SALT_LEN = 256
MAX_CONTAINERS = 64  # maps and arrays in one message: a generate message has 3
OPS = ("generate", "abort", "stats", "ping")
WAITING = ("draining", "manager_unreachable")  # a heartbeat's reasons (None: queued or computing)


def pack(msg: Mapping[str, Any]) -> bytes:
    """One message's bytes; ValueError for what msgpack cannot encode (an int beyond 64 bits)."""
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"cannot encode the request: {e}; integers must fit in 64 bits") from None


def decode(payload: bytes) -> dict:
    """One message map; ValueError for anything else (not msgpack, too big, too many containers)."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(payload)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        msg = unpack_counted(payload, MAX_CONTAINERS, f"more than {MAX_CONTAINERS} maps and arrays", unique_keys=True,
                             max_array_len=MAX_PROMPT_TOKENS, max_map_len=32, max_str_len=1 << 16,
                             max_bin_len=1 << 16, max_ext_len=0)
    except Exception as e:  # msgpack raises several types (ValueError, ExtraData, StackError, ...)
        raise ValueError(f"not one msgpack value within the limits: {type(e).__name__}: {e}"[:200]) from None
    if type(msg) is not dict:
        raise ValueError(f"a message must be a msgpack map, got {type(msg).__name__}")
    return msg


def client_id(msg: dict) -> str:
    """The client's id for its request: a str of 1-128 chars or an int (sent back as a str)."""
    cid = msg.get("id")
    if type(cid) is int and -(1 << 63) <= cid < 1 << 64:
        return str(cid)
    if type(cid) is str and 0 < len(cid) <= MAX_ID_LEN:
        return cid
    raise ValueError(f"id must be a str of 1-{MAX_ID_LEN} chars or an int, got {type(cid).__name__}")


def op_of(msg: dict) -> str:
    op = msg.get("op")
    if type(op) is not str or op not in OPS:
        raise ValueError(f"unknown op {op!r:.40}; known: {', '.join(OPS)}")
    return op


def params_to_wire(params: SamplingParams) -> dict:
    """A ``SamplingParams`` as the ``params`` map (the text-only ``stop`` stays behind)."""
    out = {k: getattr(params, k) for k in params.__dataclass_fields__ if k not in TEXT_ONLY}
    out["stop_token_ids"] = list(params.stop_token_ids)
    if not params.priority:
        del out["priority"]  # the default: messages as before priorities
    return out


# -- client -> worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    client_id: str
    prompt: list[int]
    params: SamplingParams | Mapping[str, Any]  # a dict only on the client side (sent as given)
    cache_salt: str | None = None  # a tenant's own prefix-cache space (shared/hashing.py)

    def to_wire(self) -> dict:
        params = params_to_wire(self.params) if isinstance(self.params, SamplingParams) else dict(self.params)
        msg = {"op": "generate", "id": self.client_id, "prompt": self.prompt, "params": params}
        if self.cache_salt is not None:
            msg["cache_salt"] = self.cache_salt
        return msg

    @classmethod
    def from_wire(cls, msg: dict) -> GenerateRequest:
        """The one validation of a generate message's shape and params (the engine checks the
        prompt's tokens and length against the model when the request is added)."""
        prompt = msg.get("prompt")
        if type(prompt) is not list:
            raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
        salt = msg.get("cache_salt")
        if salt is not None and (type(salt) is not str or not 0 < len(salt) <= MAX_SALT_LEN):
            raise ValueError(f"cache_salt must be a str of 1-{MAX_SALT_LEN} chars, got {type(salt).__name__}")
        return cls(client_id(msg), prompt, SamplingParams.from_wire(msg.get("params")), salt)


@dataclass(frozen=True)
class Control:
    """``abort``, ``stats`` or ``ping`` of one id."""

    op: str
    client_id: str

    def to_wire(self) -> dict:
        return {"op": self.op, "id": self.client_id}

    @classmethod
    def from_wire(cls, msg: dict) -> Control:
        return cls(op_of(msg), client_id(msg))


# -- worker -> client ----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenMessage:
    """One sampled token of sample ``index`` (``token`` None: the sample ended without one)."""

    client_id: str
    index: int = 0
    token: int | None = None
    finished: bool = False
    reason: str | None = None  # when finished: stop, length, abort, "error: ..."
    logprob: float | None = None  # with params.logprobs: the sampled token's
    top_logprobs: list | None = None  # [[token, logprob]...], best first

    def to_wire(self) -> dict:
        body = {"id": self.client_id, "index": self.index, "token": self.token, "finished": self.finished,
                "reason": self.reason}
        if self.logprob is not None:
            body.update(logprob=self.logprob, top_logprobs=self.top_logprobs)
        return body

    @classmethod
    def from_wire(cls, msg: dict) -> TokenMessage:
        return cls(msg.get("id"), msg.get("index", 0), msg.get("token"), bool(msg.get("finished")),
                   msg.get("reason"), msg.get("logprob"), msg.get("top_logprobs"))


@dataclass(frozen=True)
class ErrorMessage:
    client_id: str
    error: str

    def to_wire(self) -> dict:
        return {"id": self.client_id, "error": self.error, "finished": True}

    @classmethod
    def from_wire(cls, msg: dict) -> ErrorMessage:
        return cls(msg.get("id"), str(msg["error"]))


@dataclass(frozen=True)
class Heartbeat:
    client_id: str
    waiting: str | None = None  # "draining", "manager_unreachable", or None

    def to_wire(self) -> dict:
        return {"id": self.client_id, "heartbeat": True, "finished": False, "waiting": self.waiting}

    @classmethod
    def from_wire(cls, msg: dict) -> Heartbeat:
        return cls(msg.get("id"), msg.get("waiting"))


@dataclass(frozen=True)
class StatsReply:
    client_id: str
    stats: dict

    def to_wire(self) -> dict:
        return {"id": self.client_id, "stats": self.stats}

    @classmethod
    def from_wire(cls, msg: dict) -> StatsReply:
        return cls(msg.get("id"), msg["stats"])


@dataclass(frozen=True)
class Pong:
    client_id: str
    pool: str
    open: tuple[str, ...] | None = None  # the ids of the asking client's open requests (None: not told)

    def to_wire(self) -> dict:
        out = {"id": self.client_id, "pong": self.pool}
        if self.open is not None:
            out["open"] = list(self.open)
        return out

    @classmethod
    def from_wire(cls, msg: dict) -> Pong:
        opened = msg.get("open")
        ok = type(opened) is list and all(type(c) is str for c in opened)
        return cls(msg.get("id"), msg["pong"], tuple(opened) if ok else None)


Reply = TokenMessage | ErrorMessage | Heartbeat | StatsReply | Pong


def parse_reply(msg: object) -> Reply | None:
    """A worker's message as its record; None for anything that is not one (a client keeps
    reading past it)."""
    if type(msg) is not dict:
        return None
    if "error" in msg:
        return ErrorMessage.from_wire(msg)
    if msg.get("heartbeat"):
        return Heartbeat.from_wire(msg)
    if "stats" in msg:
        return StatsReply.from_wire(msg)
    if "pong" in msg:
        return Pong.from_wire(msg)
    return TokenMessage.from_wire(msg)
