"""Nothing heavy on the front door's event loop: a prompt too long for the model is refused by its
size before any tokenizing, and a big prompt is tokenized in a thread while the loop serves on.
The first over real HTTP (a real front door, a real worker); the second on a real FrontDoor and a
real tokenizer trained here, watching which thread encodes."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from helpers.frontend import Stack
from helpers.tokenizers import make_tokenizer_dir

from kvpool.frontend.errors import APIError
from kvpool.frontend.params import parse_request
from kvpool.frontend.service import INLINE_TOKENIZE_CHARS, FrontDoor, FrontDoorConfig
from kvpool.frontend.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    s = Stack(workers=1)
    yield s
    s.close()


def test_a_prompt_longer_than_the_model_is_refused_by_its_size(stack) -> None:
    text = "word " * (3 << 20)  # 15 MiB: under the body limit, far over max_model_len tokens
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 2},
                   timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["reason"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "maximum context length" in err["message"] and "more than" in err["message"]  # refused unread
    chat = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert httpx.get(stack.url + "/health", timeout=10).status_code == 200  # and it serves on
    ok = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


def test_a_big_prompt_is_tokenized_off_the_event_loop(tmp_path) -> None:
    tok = HFTokenizer(make_tokenizer_dir(str(tmp_path)))
    threads: list[str] = []
    encode = tok.encode

    def watched(text: str, add_special_tokens: bool = False) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    tok.encode = watched  # type: ignore[method-assign]  (records where the real encode runs)
    fd = FrontDoor(FrontDoorConfig(managers=("ipc:///nonexistent/manager.sock",)))

    async def run() -> tuple[list[list[int]], list[list[int]], int]:
        loop_thread = threading.current_thread().name
        big = parse_request({"model": "m", "prompt": "hello world " * (INLINE_TOKENIZE_CHARS // 4)}, chat=False)
        small = parse_request({"model": "m", "prompt": "hello world"}, chat=False)
        ticks = 0

        async def ticker() -> None:  # the loop runs while the big prompt is tokenized
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        got_big = await fd.tokenize(big, tok, max_len=1 << 20)
        t.cancel()
        got_small = await fd.tokenize(small, tok, max_len=1 << 20)
        assert threads[0] != loop_thread and threads[1] == loop_thread  # big: a thread; small: inline
        return got_big, got_small, ticks

    got_big, got_small, ticks = asyncio.run(run())
    assert got_big[0] == encode("hello world " * (INLINE_TOKENIZE_CHARS // 4), True) and got_small[0]
    assert ticks > 0
    with pytest.raises(APIError) as ei:  # and the size bound holds on this tokenizer too
        asyncio.run(fd.tokenize(parse_request({"model": "m", "prompt": "x" * 10_000}, chat=False), tok, max_len=10))
    assert ei.value.reason == "context_length_exceeded"

