"""The generate service's message handling, in process (no socket is bound)."""

from __future__ import annotations

from helpers.worker import make_engine, make_prompt

from kvpool.shared.generate import pack
from kvpool.worker.server import WorkerServer


def test_abort_reaches_only_the_senders_request():
    # every GenerateClient numbers its requests from "generate-0": ids collide across clients
    engine = make_engine()
    server = WorkerServer(engine, "inproc://unused", "test")
    sent: list[tuple[bytes, dict]] = []
    server._reply = lambda ident, body: sent.append((ident, body))
    try:
        for ident, seed in ((b"A", 0), (b"B", 1)):
            server._handle(ident, pack({"op": "generate", "id": "generate-0", "prompt": make_prompt(8, seed),
                                        "params": {"max_tokens": 4}}))
        server._handle(b"A", pack({"op": "abort", "id": "generate-0"}))
        assert sent == [(b"A", {"id": "generate-0", "index": 0, "token": None, "finished": True,
                                "reason": "abort"})]
        assert list(server._clients.values()) == [(b"B", "generate-0")]
        assert [r.request_id for r in engine.scheduler.waiting] == ["c1"]
    finally:
        server._sock.close()
        server._ctx.term()


HOSTILE_PARAMS = [
    {"n": 2.5}, {"seed": "x", "temperature": 1}, {"seed": 1.5, "temperature": 1.0}, {"seed": -(1 << 62)}, {"seed": -1},
    {"seed": True}, {"n": True}, {"n": 65}, {"n": "2"}, {"max_tokens": 2.0},
    {"max_tokens": 1 << 40}, {"seed": 1 << 63}, {"max_tokens": None}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"temperature": "hot"}, {"temperature": [1]}, {"top_p": 1.5}, {"top_p": float("nan")}, {"top_p": None},
    {"ignore_eos": 1}, {"ignore_eos": "yes"}, {"top_k": -1}, {"top_k": 2.0}, {"bogus": 1}, [1, 2], "params", 7,
    {"stop": ["x"]}, {"logprobs": 21}, {"logprobs": True}, {"min_tokens": 99}, {"presence_penalty": float("nan")},
    {"frequency_penalty": 3}, {"stop_token_ids": [True]}, {"stop_token_ids": 5}, {"stop_token_ids": [0] * 257},
]


def _server():
    engine = make_engine()
    server = WorkerServer(engine, "inproc://unused", "test")
    sent: list[tuple[bytes, dict]] = []
    server._reply = lambda ident, body: sent.append((ident, body))
    return engine, server, sent


def _close(server):
    server._sock.close()
    server._ctx.term()


def test_hostile_params_get_an_error_reply_and_queue_nothing():
    engine, server, sent = _server()
    try:
        for params in HOSTILE_PARAMS:
            sent.clear()
            server._handle(b"A", pack({"op": "generate", "id": "g", "prompt": make_prompt(8, 0), "params": params}))
            assert len(sent) == 1 and sent[0][1]["finished"] is True and "error" in sent[0][1], params
            assert not engine.has_work() and server._clients == {}, params
        server.shutdown()  # the shutdown path survives too, and deregisters
    finally:
        _close(server)


HOSTILE_MESSAGES = [
    {"op": "generate", "id": "g", "prompt": [1.0, 2]}, {"op": "generate", "id": "g", "prompt": [True]},
    {"op": "generate", "id": "g", "prompt": [-1]}, {"op": "generate", "id": "g", "prompt": [1 << 63]},
    {"op": "generate", "id": "g", "prompt": []}, {"op": "generate", "id": "g", "prompt": list(range(2, 300))},
    {"op": "generate", "id": "g", "prompt": "abc"}, {"op": "generate", "id": "g"},
    {"op": "generate", "id": ["nested"] * 3, "prompt": [5]}, {"op": "generate", "id": "x" * 1000, "prompt": [5]},
    {"op": [], "id": "g"}, {"op": None}, {"id": "g"}, {"op": "abort", "id": {"a": 1}},
]


def test_hostile_messages_get_an_error_reply_and_queue_nothing():
    engine, server, sent = _server()
    try:
        deep: list = []
        for _ in range(1000):
            deep = [deep]
        for msg in [*HOSTILE_MESSAGES, {"op": "generate", "id": "g", "prompt": [5], "params": {"n": deep}}]:
            sent.clear()
            server._handle(b"A", pack(msg))
            assert len(sent) == 1 and "error" in sent[0][1], msg
            assert not engine.has_work(), msg
        for payload in (b"\xc1", b"", b"\x91" * 5000 + b"\x90", pack([1, 2]), b"\xd9\x05ab"):
            sent.clear()
            server._handle(b"A", payload)
            assert len(sent) == 1 and "error" in sent[0][1], payload[:8]
        assert not engine.has_work()
    finally:
        _close(server)


def test_an_array_of_empty_maps_is_refused_while_decoding():
    import tracemalloc

    engine, server, sent = _server()
    n = (4 << 20) - 64
    head = pack({"op": "generate", "id": "g"})[1:]  # the map's two pairs, without its header
    bomb = b"\x83" + head + b"\xa6prompt" + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    try:
        tracemalloc.start()
        try:
            server._handle(b"A", bomb[: 4 << 20])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(sent) == 1 and "error" in sent[0][1] and not engine.has_work()
        assert peak < 16 << 20, f"decoding built {peak >> 20} MiB before refusing"
    finally:
        _close(server)
