"""KV events in vLLM's wire format: a PUB socket plus a replay socket.

Every published message has three frames: ``topic`` (the pool name, UTF-8), an 8-byte big-endian
sequence number (one counter per publisher, starting at 0), and a msgpack ``KVEventBatch``. Two
formats (``events_format``), each checked against that vLLM release's own struct definitions
(tests/helpers/vllm_structs.py):

``vllm-0.33`` (default), vLLM 0.33.0: an array-like batch of tagged maps (fields at their
default are left out, as vLLM's ``omit_defaults`` does; ``lora_id``, ``medium`` and ``lora_name``
have no default, so they are always there)::

    [ts: float, events: [event, ...]]
    event = {"type": "BlockStored", "block_hashes": [bin32...], "parent_block_hash": bin32 | nil,
             "token_ids": [], "block_size": int, "lora_id": nil, "medium": "GPU", "lora_name": nil}
          | {"type": "BlockRemoved", "block_hashes": [bin32...], "medium": "GPU"}
          | {"type": "AllBlocksCleared"}

``vllm-0.11``, vLLM 0.11.0 and the releases around it: the same batch, each event a tagged array
``["BlockStored", hashes, parent, [], block_size, nil, "GPU"]``, ``["BlockRemoved", hashes,
"GPU"]``, ``["AllBlocksCleared"]``.

The manager never sees token ids, so ``token_ids`` is empty; it sends no data-parallel rank.

Replay: a ROUTER socket. A client (DEALER, or REQ) sends one frame, the 8-byte big-endian first
sequence number it wants; the publisher answers with one message per buffered batch from there
on, then an end marker with ``seq = 2**64 - 1`` (vLLM's ``-1``). As vLLM 0.33.0 does, a
``vllm-0.33`` publisher answers ``[topic, seq, payload]`` and ends with ``[b"", END, b""]``; a
``vllm-0.11`` publisher answers ``[seq, payload]`` and ends with ``[END, b""]``, as 0.11.0 did.
The buffer keeps the last ``buffer_size`` batches.

The publisher is driven by the manager loop (single-threaded): ``publish`` once per iteration
per pool that has events, ``serve_replay`` when the replay socket is readable or a replay is
still being sent. The replay socket never holds the loop: one call sends at most
``replay_budget`` batches, round robin over the replays in progress, and a replay waits while
its client's queue is full. Replay requests are rate-limited (a token bucket of
``replay_rate`` per second, ``replay_rate`` deep) and at most ``max_replays`` run at once; a
request beyond either gets the end marker alone at once (nothing replayed: ask again later).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1
REPLAY_TIMEOUT_S = 30.0
MEDIUM = "GPU"
FORMATS = ("vllm-0.33", "vllm-0.11")  # events_format values: the vLLM release whose format is sent
DEFAULT_FORMAT = "vllm-0.33"
_ORDER = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
          "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}  # vllm-0.11 array positions


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"events_format must be one of {', '.join(FORMATS)} (the vLLM release whose KV-event "
                         f"format subscribers decode), got {fmt!r}")
    return fmt


def _event_map(ev: KVEvent, block_size: int) -> dict:
    """One block-pool event (manager/core/kv_events.py) as vLLM 0.33's tagged map."""
    if isinstance(ev, BlockStored):
        return {"type": "BlockStored", "block_hashes": ev.hashes, "parent_block_hash": ev.parent, "token_ids": [],
                "block_size": block_size, "lora_id": None, "medium": ev.medium, "lora_name": None}
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": ev.hashes, "medium": ev.medium}
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise ValueError(f"unknown block-pool event {ev!r:.80}")


def encode_events(events: list[KVEvent], block_size: int, fmt: str = DEFAULT_FORMAT) -> list:
    """Block-pool events as the events of a vLLM ``KVEventBatch`` in format ``fmt``."""
    maps = [_event_map(ev, block_size) for ev in events]
    if fmt == "vllm-0.33":
        return maps
    check_format(fmt)
    return [[m["type"], *(m[k] for k in _ORDER[m["type"]])] for m in maps]


def encode_batch(events: list[KVEvent], block_size: int, fmt: str = DEFAULT_FORMAT, ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, encode_events(events, block_size, fmt)],
                         use_bin_type=True)


@dataclass
class DecodedBatch:
    ts: float
    events: list[dict]  # every event as a vllm-0.33 map, whatever the format it came in
    format: str  # "vllm-0.33" or "vllm-0.11" (an empty batch reads as the default)
    data_parallel_rank: int | None = None


def decode_batch(payload: bytes) -> DecodedBatch:
    """A batch in either format (a subscriber's view: ``kvpool events``, tests)."""
    batch = msgpack.unpackb(payload, raw=False)
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3 or not isinstance(batch[1], list):
        raise ValueError("not a KV-event batch: expected [ts, events] or [ts, events, data_parallel_rank]")
    arrays = [ev for ev in batch[1] if isinstance(ev, list)]
    if arrays and len(arrays) != len(batch[1]):
        raise ValueError("a KV-event batch mixes array (vllm-0.11) and map (vllm-0.33) events")
    events = [_array_to_map(ev) for ev in arrays] if arrays else batch[1]
    if not all(isinstance(ev, dict) and isinstance(ev.get("type"), str) for ev in events):
        raise ValueError("not a KV-event batch: every event must be a map with a 'type' or a tagged array")
    return DecodedBatch(batch[0], events, "vllm-0.11" if arrays else "vllm-0.33",
                        batch[2] if len(batch) == 3 else None)


def _array_to_map(ev: list) -> dict:
    keys = _ORDER.get(ev[0]) if ev else None
    if keys is None or len(ev) != 1 + len(keys):
        raise ValueError(f"not a vllm-0.11 KV event: {ev[:1]!r} with {len(ev) - 1} fields")
    out = {"type": ev[0], **dict(zip(keys, ev[1:]))}
    if ev[0] == "BlockStored":
        out["lora_name"] = None  # a 0.33 field 0.11 did not have
    return out


@dataclass
class Replay:
    """One replay in progress: where its answer goes and the next sequence number to send."""

    envelope: list[bytes]
    next_seq: int
    deadline: float  # a client that has not taken its replay by then loses it


class EventPublisher:
    def __init__(
        self, ctx: zmq.Context, pub_endpoint: str, replay_endpoint: str | None = None, buffer_size: int = 10_000,
        fmt: str = DEFAULT_FORMAT, *, replay_budget: int = 256, replay_rate: float = 20.0, max_replays: int = 16,
    ) -> None:
        self.format = check_format(fmt)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.replay: zmq.Socket | None = None
        try:
            self.pub.bind(pub_endpoint)
            if replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises: the replay waits
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self.close()  # an open socket would block the context's term()
            raise
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_size)
        self.next_seq = 0
        self.replay_budget, self.replay_rate, self.max_replays = replay_budget, replay_rate, max_replays
        self.replays: deque[Replay] = deque()
        self.replays_refused = 0
        self._stalled = False  # the last call sent nothing: every replay's client queue was full
        self._tokens, self._refilled = replay_rate, time.monotonic()

    def publish(self, pool: str, events: list[KVEvent], block_size: int) -> int:
        """Sends one batch; returns its sequence number."""
        payload = encode_batch(events, block_size, self.format)
        seq = self.next_seq
        self.next_seq += 1
        topic = pool.encode()
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], copy=False)
        self.buffer.append((seq, topic, payload))
        return seq

    @property
    def replay_pending(self) -> bool:
        """Replays that can make progress now (the loop then polls without waiting)."""
        return bool(self.replays) and not self._stalled

    def serve_replay(self) -> None:
        """Takes new replay requests, then sends at most ``replay_budget`` batches (non-blocking)."""
        if self.replay is None:
            raise RuntimeError("no replay socket: pass replay_endpoint")
        for _ in range(4 * self.max_replays):
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._take(frames)
        self._send_some(self.replay_budget)

    def _take(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        envelope = [ident, b""] if body and body[0] == b"" else [ident]
        body = [f for f in body if f]
        if len(body) != 1 or len(body[0]) != 8:
            log.warning("replay request with bad framing: answered with the end marker")
            self._end(envelope)
            return
        now = time.monotonic()
        self._tokens = min(self.replay_rate, self._tokens + (now - self._refilled) * self.replay_rate)
        self._refilled = now
        if self._tokens < 1 or len(self.replays) >= self.max_replays:
            self.replays_refused += 1
            log.warning("replay request refused (rate limit or %d replays running): end marker only",
                        len(self.replays))
            self._end(envelope)
            return
        self._tokens -= 1
        self.replays.append(Replay(envelope, int.from_bytes(body[0], "big"), now + REPLAY_TIMEOUT_S))

    def _send_some(self, budget: int) -> None:
        """Round robin over the replays in progress, one batch each in turn."""
        waiting: list[Replay] = []
        now, sent = time.monotonic(), 0
        while self.replays and budget > 0:
            rep = self.replays.popleft()
            if now > rep.deadline:
                log.warning("a replay client did not read its replay in %.0fs: dropped", REPLAY_TIMEOUT_S)
                continue
            first = self.buffer[0][0] if self.buffer else self.next_seq
            index = max(rep.next_seq, first) - first
            try:
                if index >= len(self.buffer):
                    self.replay.send_multipart([*rep.envelope, *self._frames(b"", END_SEQ, b"")], zmq.NOBLOCK)  # type: ignore[union-attr]
                    continue
                seq, topic, payload = self.buffer[index]
                self.replay.send_multipart([*rep.envelope, *self._frames(topic, seq, payload)], zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                waiting.append(rep)  # its client's queue is full: later
                continue
            except zmq.ZMQError:
                continue  # the client is gone
            budget -= 1
            sent += 1
            rep.next_seq = seq + 1
            self.replays.append(rep)
        self.replays.extend(waiting)
        self._stalled = sent == 0

    def _frames(self, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
        """One replay answer: vLLM 0.33.0 sends [topic, seq, payload] (the end marker's topic is
        empty); 0.11.0 sent [seq, payload]."""
        if self.format == "vllm-0.33":
            return [topic, seq.to_bytes(8, "big"), payload]
        return [seq.to_bytes(8, "big"), payload]

    def _end(self, envelope: list[bytes]) -> None:
        try:
            self.replay.send_multipart([*envelope, *self._frames(b"", END_SEQ, b"")], zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError:
            pass  # the client is gone or not reading: nothing to tell it

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)


class LoopPublisher:
    """The manager loop's event sink (manager/store/base.py ``EventSink``) over a ZeroMQ
    ``EventPublisher``: one batch per pool per iteration, topic = the pool's name, block size
    from ``block_size_of(pool)``. The loop polls ``replay_socket`` and calls ``serve_replay``."""

    def __init__(self, publisher: EventPublisher, block_size_of: Callable[[str], int]) -> None:
        self.zmq = publisher
        self.block_size_of = block_size_of

    @property
    def replay_socket(self) -> zmq.Socket | None:
        return self.zmq.replay

    @property
    def replay_pending(self) -> bool:
        return self.zmq.replay_pending

    @property
    def replays(self) -> int:
        return len(self.zmq.replays)

    def publish(self, pool: str, epoch: int, events: list[KVEvent]) -> None:
        self.zmq.publish(pool, events, self.block_size_of(pool))

    def serve_replay(self) -> None:
        self.zmq.serve_replay()

    def close(self) -> None:
        self.zmq.close()
