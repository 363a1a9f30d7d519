"""A client of the manager's KV-event sockets (manager/events.py): subscribe, and replay first.

``kvpool events`` prints what this reads; a KV-aware router would apply it (``CachedView``). The
subscription is made before any replay, so no batch falls between the buffered ones and the live
ones: a caller skips live batches whose ``seq`` it already got from the replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import zmq

from kvpool.manager.events import END_SEQ, decode_batch


@dataclass(frozen=True)
class EventBatch:
    topic: str  # the pool's name; "(replay)" for a vllm-0.11 replay answer (which sends no topic)
    seq: int
    ts: float
    events: list[dict]  # vLLM 0.33 event maps ({"type": "BlockStored", ...}), whatever the format sent
    format: str  # the format it came in: "vllm-0.33" or "vllm-0.11" (manager/events.py)
    error: str | None = None  # why the payload did not decode (then ts is 0 and events empty)


def read_batch(topic: str, seq: int, payload: bytes) -> EventBatch:
    """One published payload, in either format; an undecodable one is reported, not raised."""
    try:
        batch = decode_batch(payload)
    except (ValueError, msgpack.UnpackException) as e:  # a publisher that is neither kvpool nor vLLM
        return EventBatch(topic, seq, 0.0, [], "?", error=str(e))
    return EventBatch(topic, seq, batch.ts, batch.events, batch.format)


DEVICE_MEDIUM = "GPU"  # vLLM's medium for the device tier (an event without one means it too)
TIER_MEDIUM = {"device": DEVICE_MEDIUM, "host": "CPU"}  # the admin ops' ``tier`` -> the events' medium


class CachedView:
    """A subscriber's copy of one pool's cached hashes, one set per tier keyed by the events'
    ``medium``: a pool with a host tier holds a hash on the device and on the host
    independently, so one set would lose the host's copy when the device's is removed. What a
    tier holds is what the manager's ``cached_hashes`` answers for it (``TIER_MEDIUM``)."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {}

    def hashes(self, medium: str = DEVICE_MEDIUM) -> set[bytes]:
        """The hashes cached in the tier named by ``medium`` (empty for a tier never seen)."""
        return self.tiers.get(medium, set())

    def apply(self, events: list[dict]) -> None:
        """Folds decoded events (``EventBatch.events``) in, in order. ``AllBlocksCleared`` names
        no medium and clears every tier, as vLLM means it."""
        for ev in events:
            kind = ev.get("type")
            if kind == "AllBlocksCleared":
                self.tiers.clear()
                continue
            medium = ev.get("medium") or DEVICE_MEDIUM
            if kind == "BlockStored":
                self.tiers.setdefault(medium, set()).update(ev["block_hashes"])
            elif kind == "BlockRemoved":
                self.tiers.get(medium, set()).difference_update(ev["block_hashes"])


class EventTail:
    """Subscribes to ``endpoint`` (only ``pools``' topics when given) and reads batches in order."""

    def __init__(self, endpoint: str, pools: tuple[str, ...] = ()) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        for topic in pools or ("",):
            self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)

    def replay(self, endpoint: str, start: int, timeout_s: float) -> list[EventBatch]:
        """The publisher's buffered batches from ``start`` on; TimeoutError when it does not answer."""
        time.sleep(0.2)  # the subscription reaches the publisher first
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while True:
                if not sock.poll(timeout_s * 1000):
                    raise TimeoutError(f"no answer from the replay socket {endpoint} within {timeout_s}s")
                frames = sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big")
                if seq == END_SEQ:
                    return out
                topic = frames[-3].decode(errors="replace") if len(frames) == 4 else "(replay)"  # vllm-0.33: a topic
                out.append(read_batch(topic, seq, frames[-1]))
        finally:
            sock.close()

    def next(self) -> EventBatch:
        """The next live batch (blocks until one arrives)."""
        topic, seq, payload = self.sub.recv_multipart()
        return read_batch(topic.decode(errors="replace"), int.from_bytes(seq, "big"), payload)

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()
