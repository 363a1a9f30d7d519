"""An attached external server (``kvpool attach``: a vLLM server whose KV cache the manager
mirrors, manager/external/): where clients reach it and where its events come from. A registry
record, journaled when the attach op makes it (manager/state/mutations.py), so a restarted or
failed-over manager attaches it again."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpool.shared.protocol import POOL_NAME, ManagerError, get_int, get_str

URL = re.compile(r"https?://[^\s/]+(/\S*)?")


@dataclass(frozen=True)
class Attachment:
    name: str
    model: str  # the id its OpenAI API serves (its --served-model-name)
    url: str  # OpenAI base URL, e.g. http://127.0.0.1:8000
    block_size: int
    topic: str  # the topic its events are published on (kv-events-config "topic")
    events: str | None = None  # its PUB endpoint when it binds one (ipc://, tcp://*:P seen as tcp://HOST:P)
    replay: str | None = None  # its replay ROUTER endpoint

    def to_wire(self) -> dict:
        return {"name": self.name, "model": self.model, "url": self.url, "block_size": self.block_size,
                "topic": self.topic, "events": self.events, "replay": self.replay}

    @staticmethod
    def from_wire(d: object) -> Attachment:
        """The one check of an attachment: the attach op's arguments, a ``[[manager.attach]]``
        table, a journal record and a snapshot's entry alike. ManagerError ``bad_field``."""
        if type(d) is not dict:
            raise ManagerError("bad_field", f"an attachment is a map, got {type(d).__name__}")
        try:
            return Attachment(get_str(d, "name", 64, pattern=POOL_NAME), get_str(d, "model", 512),
                              check_url(d.get("url")), get_int(d, "block_size", 1, 1 << 16),
                              get_str(d, "topic", 256), check_endpoint("events", d.get("events")),
                              check_endpoint("replay", d.get("replay")))
        except ValueError as e:
            raise ManagerError("bad_field", str(e)) from None


def check_endpoint(key: str, v: object) -> str | None:
    if v is None:
        return None
    if type(v) is not str or not 0 < len(v) <= 512 or not v.startswith(("ipc://", "tcp://")):
        raise ValueError(f"{key} must be an ipc:// or tcp:// endpoint, got {v!r:.80}")
    return v


def check_url(v: object) -> str:
    if type(v) is not str or len(v) > 512 or not URL.fullmatch(v):
        raise ValueError(f"url must be an http(s):// base URL, got {v!r:.80}")
    return v.rstrip("/")
