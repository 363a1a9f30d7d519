"""The generate socket's messages as the worker reads them: bounded decoding, one record.

Anyone who can reach the socket can send anything, so a payload is decoded with msgpack's
Unpacker limits (no array or map longer than a real message needs, no ext types) and at most
``MAX_CONTAINERS`` maps and arrays, counted as they are built (no bomb of empty maps, no deep
nesting) and a generate message becomes a ``GenerateMessage`` only through ``parse_generate``;
``Engine.add_request`` checks the prompt against the model and
``SamplingParams`` checks its own fields. Every failure is a ValueError whose text goes back to
the client; nothing here raises anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.shared.bounded import unpack_counted
from kvpool.worker.sampler import SamplingParams

MAX_MESSAGE_BYTES = 4 << 20
MAX_PROMPT_TOKENS = 1 << 20  # longer than any max_model_len we accept; the engine checks the real one
MAX_ID_LEN = 128
MAX_SALT_LEN = 256
MAX_CONTAINERS = 64  # maps and arrays in one message: a generate message has 3
OPS = ("generate", "abort", "stats", "ping")


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


@dataclass(frozen=True)
class GenerateMessage:
    client_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # a tenant's own prefix-cache space (shared/hashing.py)


def parse_generate(msg: dict) -> GenerateMessage:
    """The one validation of a generate message's shape and params (the engine checks the
    prompt's tokens and length against the model when the request is added)."""
    prompt = msg.get("prompt")
    if type(prompt) is not list:
        raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    salt = msg.get("cache_salt")
    if salt is not None and (type(salt) is not str or not 0 < len(salt) <= MAX_SALT_LEN):
        raise ValueError(f"cache_salt must be a str of 1-{MAX_SALT_LEN} chars, got {type(salt).__name__}")
    return GenerateMessage(client_id(msg), prompt, SamplingParams.from_wire(msg.get("params")), salt)
