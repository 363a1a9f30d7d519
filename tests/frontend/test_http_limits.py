"""The front door's HTTP bounds and API keys, over real sockets against a real front door: idle
connections, headers or bodies that trickle, too many connections, and `--api-key` as vLLM
checks it (the openai client included). Bounds are given small here and checked with wide
margins, so the tests hold on a loaded machine; what they assert is that nothing is held for
ever, not how fast."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from helpers.frontend import Stack

from kvpool.frontend.http_limits import HTTPLimits

LIMITS = HTTPLimits(max_connections=8, header_timeout_s=0.5, body_timeout_s=1.0, keep_alive_s=0.5)
MARGIN_S = 20.0  # far above every bound above: only a connection held for ever fails


@pytest.fixture(scope="module")
def door():
    s = Stack(workers=0, limits=LIMITS, api_keys=("key-one", "key-two"))
    yield s
    s.close()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=MARGIN_S)
    return s


def closed_by_server(s: socket.socket) -> bytes:
    """Reads until the server closes the connection (raises on MARGIN_S without it); what it sent."""
    s.settimeout(MARGIN_S)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def served(door: Stack) -> None:
    r = httpx.get(door.url + "/health", timeout=MARGIN_S)
    assert r.status_code == 503 and r.json()["status"] == "no workers"  # answered, and open without a key


def test_idle_connections_are_closed_once_their_headers_are_late(door):
    socks = [connect(door.url) for _ in range(6)]
    t0 = time.monotonic()
    for s in socks:
        assert closed_by_server(s) == b""  # nothing sent, nothing answered: just closed
        s.close()
    assert time.monotonic() - t0 < MARGIN_S
    served(door)


def test_headers_sent_a_byte_at_a_time_do_not_hold_the_connection(door):
    s = connect(door.url)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * 200 + b"\r\n\r\n"
    sent, closed = 0, False
    try:
        for b in head:  # 0.1 s a byte: the whole head would take over 20 s
            s.sendall(bytes((b,)))
            sent += 1
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    if not closed:
        closed = closed_by_server(s) == b""
    s.close()
    assert closed and sent < len(head), f"the server read {sent} of {len(head)} header bytes and kept listening"
    served(door)


def test_a_body_that_trickles_gets_a_408(door):
    s = connect(door.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n"
              b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    answer = closed_by_server(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"reason":"body_timeout"' in answer.replace(b" ", b"")
    served(door)


def test_connections_beyond_the_limit_are_closed_at_once_and_the_rest_still_serve(door):
    held = [connect(door.url) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.1)  # accepted by now
        extra = connect(door.url)
        assert closed_by_server(extra) == b""
        extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + MARGIN_S
    while True:  # the held ones are gone once the server has seen them close
        try:
            served(door)
            break
        except (httpx.HTTPError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic key-one", "key-one"])
def test_v1_needs_one_of_the_api_keys(door, auth):
    headers = {"authorization": auth} if auth else {}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, door.url + path, headers=headers, json={"model": "tiny", "prompt": "hi"},
                          timeout=MARGIN_S)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_either_key_opens_v1_and_the_openai_client_sees_a_wrong_key_as_an_authentication_error(door):
    for key in ("key-one", "key-two"):
        r = httpx.get(door.url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=MARGIN_S)
        assert r.status_code == 200 and r.json()["object"] == "list"
    good = openai.OpenAI(base_url=door.url + "/v1", api_key="key-two", max_retries=0)
    assert good.models.list().data == []
    bad = openai.OpenAI(base_url=door.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    metrics = httpx.get(door.url + "/metrics", timeout=MARGIN_S)
    assert metrics.status_code == 200  # scrapers carry no key


def test_accepted_connections_send_without_nagle_delay(door) -> None:
    """Every accepted connection has TCP_NODELAY: without it a keep-alive response written in two
    parts (headers, body) waits for the client's delayed ACK (40 ms a request on Linux)."""
    s = connect(door.url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(MARGIN_S)
        assert s.recv(65536).startswith(b"HTTP/1.1 ")
        conns = list(door.fd.server.server_state.connections)
        assert conns, "the server tracks no connection"
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        s.close()
