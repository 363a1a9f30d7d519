"""The generate client's core: request ids and bytes, and what a reply means for a stream."""

from __future__ import annotations

import time

import msgpack
import pytest

from kvpool.client.generate_core import GenerateCore, Stream, WorkerUnavailable
from kvpool.shared.generate import ErrorMessage, Heartbeat, Pong, TokenMessage


def test_ids_and_messages_are_the_wire_maps():
    core = GenerateCore("fd")
    rid, payload = core.generate([1, 2], {"max_tokens": 3}, "salt")
    assert rid == "fd-0" and msgpack.unpackb(payload) == {
        "op": "generate", "id": "fd-0", "prompt": [1, 2], "params": {"max_tokens": 3}, "cache_salt": "salt"}
    assert core.control("abort", "fd-0") == ("fd-0", msgpack.packb({"op": "abort", "id": "fd-0"}))
    assert GenerateCore().control("ping")[0] == "ping-0"


def test_a_stream_ends_when_every_sample_finished():
    s = Stream("r", 2, manager_grace_s=5.0)
    assert s.feed(TokenMessage("other", 0, 1, True)) is None and not s.done
    assert s.feed(Heartbeat("r", None)) is None and s.feed(Pong("r", "p")) is None
    assert s.feed(TokenMessage("r", 0, 5)) == TokenMessage("r", 0, 5)
    s.feed(TokenMessage("r", 1, None, True, "length"))
    assert s.open_samples == {0} and not s.done
    s.feed(TokenMessage("r", 0, 6, True, "stop"))
    assert s.done


def test_a_refusal_and_a_drain_raise():
    s = Stream("r", 0, manager_grace_s=5.0)  # n < 1: waits for the refusal
    with pytest.raises(ValueError, match="the worker refused the request: bad n"):
        s.feed(ErrorMessage("r", "bad n"))
    assert s.done
    with pytest.raises(WorkerUnavailable) as ei:
        Stream("r", 1, 5.0).feed(Heartbeat("r", "draining"))
    assert ei.value.cause == "draining"


def test_an_unreachable_manager_is_reported_after_the_grace():
    s = Stream("r", 1, manager_grace_s=0.05)
    assert s.feed(Heartbeat("r", "manager_unreachable")) is None and s.manager.since is not None
    s.feed(Heartbeat("r", None))
    assert s.manager.since is None  # it answered again
    s.feed(Heartbeat("r", "manager_unreachable"))
    time.sleep(0.06)
    with pytest.raises(WorkerUnavailable) as ei:
        s.feed(Heartbeat("r", "manager_unreachable"))
    assert ei.value.cause == "manager_unreachable"
