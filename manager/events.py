"""KV events in vLLM's wire format: a PUB socket plus a replay socket.

Every published message has three frames: ``topic`` (the pool name, UTF-8), an 8-byte big-endian
sequence number (one counter per publisher, starting at 0), and a msgpack ``KVEventBatch``::

    [ts: float, events: [event, ...]]
    event = ["BlockStored", block_hashes: [bin32...], parent_block_hash: bin32 | nil,
             token_ids: [], block_size: int, lora_id: nil, medium: "GPU"]
          | ["BlockRemoved", block_hashes: [bin32...], medium: "GPU"]
          | ["AllBlocksCleared"]

That is the array-like, tagged encoding vLLM's publisher produces, so existing KV-aware routers
can subscribe. The manager never sees token ids, so ``token_ids`` is empty.

Replay: a ROUTER socket. A client (DEALER, or REQ) sends one frame, the 8-byte big-endian first
sequence number it wants; the publisher answers with one message ``[seq, payload]`` per buffered
batch from there on, then ``[seq = 2**64 - 1, b""]`` as the end marker. The buffer keeps the last
``buffer_size`` batches.

The publisher is driven by the manager loop (single-threaded): ``publish`` once per iteration
per pool that has events, ``serve_replay`` when the replay socket is readable.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import msgpack
import zmq

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1
MEDIUM = "GPU"


def encode_events(events: list[KVEvent], block_size: int) -> list:
    """Turns block-pool events (manager/core/kv_events.py) into vLLM event arrays."""
    out = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(["BlockStored", ev.hashes, ev.parent, [], block_size, None, MEDIUM])
        elif isinstance(ev, BlockRemoved):
            out.append(["BlockRemoved", ev.hashes, MEDIUM])
        elif isinstance(ev, AllBlocksCleared):
            out.append(["AllBlocksCleared"])
        else:
            raise ValueError(f"unknown block-pool event {ev!r:.80}")
    return out


def decode_batch(payload: bytes) -> tuple[float, list]:
    ts, events = msgpack.unpackb(payload, raw=False)[:2]
    return ts, events


class EventPublisher:
    def __init__(
        self, ctx: zmq.Context, pub_endpoint: str, replay_endpoint: str | None = None, buffer_size: int = 10_000
    ) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.replay: zmq.Socket | None = None
        try:
            self.pub.bind(pub_endpoint)
            if replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self.close()  # an open socket would block the context's term()
            raise
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_size)
        self.next_seq = 0

    def publish(self, pool: str, events: list[KVEvent], block_size: int) -> int:
        """Sends one batch; returns its sequence number."""
        payload = msgpack.packb([time.time(), encode_events(events, block_size)], use_bin_type=True)
        seq = self.next_seq
        self.next_seq += 1
        topic = pool.encode()
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], copy=False)
        self.buffer.append((seq, topic, payload))
        return seq

    def serve_replay(self) -> None:
        """Answers every pending replay request (non-blocking)."""
        assert self.replay is not None
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, body = frames[0], frames[1:]
            envelope = [ident, b""] if body and body[0] == b"" else [ident]
            body = [f for f in body if f]
            if len(body) != 1 or len(body[0]) != 8:
                log.warning("replay request with bad framing dropped")
                self.replay.send_multipart([*envelope, END_SEQ.to_bytes(8, "big"), b""])
                continue
            start = int.from_bytes(body[0], "big")
            for seq, _topic, payload in self.buffer:
                if seq >= start:
                    self.replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([*envelope, END_SEQ.to_bytes(8, "big"), b""])

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

    def publish(self, pool: str, epoch: int, events: list[KVEvent]) -> None:
        self.zmq.publish(pool, events, self.block_size_of(pool))

    def serve_replay(self) -> None:
        self.zmq.serve_replay()

    def close(self) -> None:
        self.zmq.close()
