"""The generate service's message handling, in process (no socket is bound)."""

from __future__ import annotations

from helpers.worker import make_engine, make_prompt

from kvpool.worker.server import WorkerServer, pack


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
        assert [r.client_id for r in engine.scheduler.waiting] == ["c1"]
    finally:
        server._sock.close()
        server._ctx.term()
