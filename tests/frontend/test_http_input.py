"""Hostile HTTP input at the front door (the gaps an audit found; the parameter checks are in
test_params.py and test_openai_api.py): bodies larger than the limit, declared or chunked,
JSON nested too deep, unknown paths and methods. Each is a 4xx with OpenAI's error body, and the
server goes on serving. A real front door on a real socket, behind a real manager (no workers:
every refusal here comes before routing).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from helpers.frontend import Stack

from kvpool.frontend.body import MAX_BODY_BYTES


@pytest.fixture(scope="module")
def door():
    s = Stack(workers=0)
    yield s
    s.close()


def raw_request(url: str, head: bytes, chunks: list[bytes]) -> tuple[int, dict]:
    """Sends ``head`` then ``chunks`` on a plain socket (what httpx will not send); the status and
    the JSON body of the answer, which may come before everything was sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        try:
            for c in chunks:
                s.sendall(c)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all: what is wanted
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            got = s.recv(65536)
            if not got:
                break
            data += got
    head_text, _, body = data.partition(b"\r\n\r\n")
    return int(head_text.split()[1]), json.loads(body[:_length(data)] or b"{}")


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def served(door: Stack) -> None:
    r = httpx.get(door.url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.json()["object"] == "list"


def test_a_declared_oversized_body_is_refused_before_it_is_read(door):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (1 << 40))  # a terabyte promised; ten bytes sent
    status, body = raw_request(door.url, head, [b'{"model": '])
    assert status == 413 and body["error"]["reason"] == "too_large" and body["error"]["type"] == "invalid_request_error"
    served(door)


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(door):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    mib = b"x" * (1 << 20)
    chunks = [b"%x\r\n%s\r\n" % (len(mib), mib)] * (MAX_BODY_BYTES // len(mib) + 1)  # no end chunk: never ends
    status, body = raw_request(door.url, head, chunks)
    assert status == 413 and body["error"]["reason"] == "too_large"
    served(door)


def test_json_nested_too_deep_is_a_400_not_a_500(door):
    r = httpx.post(door.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "body" and "nested" in err["message"]
    served(door)


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/completions", 405), ("POST", "/v1/embeddings", 404),
                                                ("GET", "/nothing/here", 404)])
def test_unknown_paths_and_methods_answer_in_openai_shape(door, method, path, status):
    r = httpx.request(method, door.url + path, json={}, timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert path in err["message"] and err["type"] in ("not_found_error", "invalid_request_error") and err["code"] == status
    served(door)


# A lone UTF-16 surrogate, as JSON writes it (an escape) and as raw bytes (ED A0 80 is U+D800
# written as if it were UTF-8): neither is Unicode text, so no tokenizer or encoder can take it.
SURROGATE_BODIES = {
    "prompt": b'{"model": "tiny", "prompt": "hi \\ud800 there"}',
    "prompt-in-a-batch": b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}',
    "streamed-prompt": b'{"model": "tiny", "prompt": "\\ud83d", "stream": true}',
    "cache_salt": b'{"model": "tiny", "prompt": "hi", "cache_salt": "\\udc00"}',
    "stop": b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}',
    "model": b'{"model": "\\ud800", "prompt": "hi"}',
}


@pytest.mark.parametrize("field", sorted(SURROGATE_BODIES))
def test_a_lone_surrogate_escape_is_a_400_naming_the_field(door, field):
    r = httpx.post(door.url + "/v1/completions", content=SURROGATE_BODIES[field],
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == {"prompt-in-a-batch": "prompt", "streamed-prompt": "prompt"}.get(field, field)
    assert "surrogate" in err["message"]
    served(door)


def test_surrogates_in_chat_content_and_raw_invalid_utf8_bytes_are_400s(door):
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = httpx.post(door.url + "/v1/chat/completions", content=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    raw = b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'
    r = httpx.post(door.url + "/v1/completions", content=raw, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body" and "UTF-8" in r.json()["error"]["message"]
    served(door)


def test_a_surrogate_pair_is_one_valid_character_and_passes_the_text_check(door):
    body = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # U+1F600, written as a pair
    r = httpx.post(door.url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["reason"] == "model_not_found", r.text  # past every input check
