"""The front door through the real openai client and raw HTTP (httpx), against real workers."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_models_lists_the_served_model(stack) -> None:
    models = client(stack).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(stack.url + "/health").json() == {"status": "ok", "workers": 2}


def test_completion_with_the_openai_client(stack) -> None:
    out = client(stack).completions.create(model="tiny", prompt="héllo wörld", max_tokens=6, temperature=0,
                                           logprobs=2)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len("héllo wörld".encode()) + 1  # bytes + bos
    assert out.usage.completion_tokens == 6 and out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert len(choice.logprobs.token_logprobs) == 6 and all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    again = client(stack).completions.create(model="tiny", prompt="héllo wörld", max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text  # greedy: the same text on whichever worker


def test_chat_streaming_with_n_samples(stack) -> None:
    stream = client(stack).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi 🙂"}], max_tokens=5, n=3, stream=True,
        temperature=1.0, seed=7, stream_options={"include_usage": True})
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["length"] * 3 and usage.completion_tokens == 15
    whole = client(stack).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi 🙂"}], max_tokens=5, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in whole.choices] == texts  # seeded: stream and whole agree
    assert len(set(texts)) > 1 and whole.choices[0].message.role == "assistant"


def test_raw_sse_ends_with_done_and_chunks_are_json(stack) -> None:
    with httpx.stream("POST", stack.url + "/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_stop_strings_cut_the_text_before_the_stop(stack) -> None:
    body = {"model": "tiny", "prompt": "stop strings", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    clean = [i for i in range(2, len(free) - 2) if "\ufffd" not in free[i:i + 2]]
    stop = free[clean[len(clean) // 2]: clean[len(clean) // 2] + 2]
    for stream in (False, True):
        if stream:
            with httpx.stream("POST", stack.url + "/v1/completions", json={**body, "stop": [stop, "\x00never"],
                                                                             "stream": True}, timeout=60) as r:
                chunks = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            got = httpx.post(stack.url + "/v1/completions", json={**body, "stop": stop}, timeout=60).json()
            text, reason = got["choices"][0]["text"], got["choices"][0]["finish_reason"]
        assert (text, reason) == (free[: free.find(stop)], "stop"), stream


def test_stop_token_ids_end_with_stop(stack) -> None:
    body = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    free = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert free["finish_reason"] == "length"
    ids = [int(t.removeprefix("token_id:")) for t in free["logprobs"]["tokens"]]
    stop = ids[5]
    got = httpx.post(stack.url + "/v1/completions", json={**body, "stop_token_ids": [stop]}, timeout=60).json()
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == ids.index(stop) + 1  # the stop id itself was generated


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
])
def test_bad_parameters_are_openai_style_400s(stack, body: dict, param: str) -> None:
    extra = {k: body.pop(k) for k in list(body) if k in ("min_tokens", "top_k", "ignore_eos")}  # vLLM's extras
    with pytest.raises(openai.BadRequestError) as ei:
        client(stack).completions.create(model="tiny", extra_body=extra, **body)
    err = ei.value.body
    assert ei.value.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"]


def test_bad_json_unknown_model_and_long_prompt(stack) -> None:
    r = httpx.post(stack.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.NotFoundError) as ei:
        client(stack).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["reason"] == "model_not_found" and "tiny" in ei.value.body["message"]
    counted = 'kvpool_frontdoor_requests_total{endpoint="completions",status="400"} '

    def refused() -> float:
        lines = [ln for ln in httpx.get(stack.url + "/metrics").text.splitlines() if ln.startswith(counted)]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = refused()
    with pytest.raises(openai.BadRequestError) as ei:  # as vLLM answers it: a 400, not a 413
        client(stack).completions.create(model="tiny", prompt="x" * 600)
    err = ei.value.body
    assert err["code"] == 400 and err["reason"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "maximum context length" in err["message"]
    assert refused() == before + 1


def test_a_hundred_concurrent_streams(stack) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
        async with c.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 3,
                "stream": True}) as r:
            return r.status_code, sse_events((await r.aread()).decode())

    async def main() -> list:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=stack.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(100)))

    results = asyncio.run(main())
    assert all(status == 200 for status, _ in results), [status for status, _ in results]
    unfinished = [ev[-3:] for _, ev in results
                  if ev[-1] != "[DONE]" or json.loads(ev[-2])["choices"][0]["finish_reason"] != "length"]
    assert not unfinished, unfinished
    per_worker = stack.fd.frontdoor.router.per_worker
    assert per_worker["w0"] > 10 and per_worker["w1"] > 10  # load spread over both


def test_metrics_have_latency_histograms(stack) -> None:
    text = httpx.get(stack.url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"kvpool_frontdoor_{name}_count" in text
    assert 'status="200"' in text


def worker_computed(stack, counter: str = "computed_tokens") -> dict[str, int]:
    from kvpool.client.generate import GenerateClient

    out = {}
    for w in stack.fd.frontdoor.directory.workers.values():
        gc = GenerateClient(w.endpoint)
        out[w.name] = gc.call("stats")["stats"][counter]
        gc.close()
    return out


def assert_pools_drain(stack) -> None:
    from kvpool.client.manager import ManagerClient

    fd = stack.fd.frontdoor
    with ManagerClient(stack.managers[0], role="admin") as mc:
        pools = {}
        deadline = time.monotonic() + 60  # a bound for a loaded machine, not a target (it returns at once when quiet)
        while time.monotonic() < deadline:
            pools = mc.stats()["pools"]
            # the front door forgets the runs too: their load and routed prefixes steer no later request
            if all(p["requests"] == 0 and p["used_blocks"] == 0 for p in pools.values()) and \
                    not fd.live and not fd.routed:
                return
            time.sleep(0.02)
    raise AssertionError(f"blocks still held: {pools}, or runs the front door still counts: {fd.live}, {fd.routed}")


def test_a_client_disconnecting_mid_stream_aborts_the_request_and_frees_its_blocks(stack) -> None:
    before = worker_computed(stack)
    with httpx.stream("POST", stack.url + "/v1/completions", json={
            "model": "tiny", "prompt": "a long one", "max_tokens": 480, "ignore_eos": True, "stream": True},
            timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in, then the client goes away
    assert any(line.startswith("data: ") for line in got)
    assert_pools_drain(stack)
    after = worker_computed(stack)
    assert all(after[k] - before[k] < 300 for k in after), (before, after)  # stopped well before 480 tokens
    assert 'endpoint="completions",status="disconnected"} 1' in httpx.get(stack.url + "/metrics").text


def test_a_client_leaving_a_whole_response_request_aborts_it_too(stack) -> None:
    """Stopped early: counted in tokens drawn, not computed (32 samples in 128 blocks preempt
    each other, and each recompute counts its whole context again: at load 15 a request cut off
    early had computed 23,618 tokens)."""
    before = worker_computed(stack, "generated_tokens")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 480, "ignore_eos": True,
            "n": 32}, timeout=0.3)
    time.sleep(0.5)  # the front door notices within DISCONNECT_POLL_S
    assert_pools_drain(stack)
    after = worker_computed(stack, "generated_tokens")
    assert all(after[k] - before[k] < 32 * 480 * 3 // 4 for k in after), (before, after)  # stopped early
    assert 'endpoint="chat",status="disconnected"} 1' in httpx.get(stack.url + "/metrics").text


def test_a_batch_of_prompts_gives_n_choices_each(stack) -> None:
    out = client(stack).completions.create(model="tiny", prompt=["first", "second one"], n=2, max_tokens=3,
                                           temperature=0)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len("first") + 1 + len("second one") + 1
    assert out.usage.completion_tokens == 12
    texts = {c.index: c.text for c in out.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy samples of one prompt agree


def test_chat_logprobs_with_the_openai_client(stack) -> None:
    out = client(stack).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, logprobs=True, top_logprobs=3, temperature=0)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the best token


def test_sampling_parameters_reach_the_worker(stack) -> None:
    def text(**extra) -> str:
        body = {"model": "tiny", "prompt": [40, 41, 42], "max_tokens": 32, "ignore_eos": True, **extra}
        return httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.5, top_k=1, seed=3) == greedy  # top_k=1 leaves only the best token
    assert text(temperature=0, frequency_penalty=2.0) != greedy  # repeats are pushed down
    assert text(temperature=1.0, seed=5) == text(temperature=1.0, seed=5) != text(temperature=1.0, seed=6)


def disconnected(stack, endpoint: str) -> int:
    m = re.search(rf'endpoint="{endpoint}",status="disconnected"}} (\d+)', httpx.get(stack.url + "/metrics").text)
    return int(m.group(1)) if m else 0


def test_a_client_leaving_before_its_body_arrives_is_counted_and_the_door_serves_on(stack) -> None:
    before = disconnected(stack, "completions")
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:  # promises 100 bytes, sends 10, leaves
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
    for _ in range(100):
        if disconnected(stack, "completions") == before + 1:
            break
        time.sleep(0.05)
    assert disconnected(stack, "completions") == before + 1
    # ignore_eos: the seeded random model may sample its eos within two tokens; served is the point
    out = client(stack).completions.create(model="tiny", prompt="still here", max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"


def test_vllms_utility_endpoints_ping_version_tokenize_detokenize(stack) -> None:
    from kvpool.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    assert httpx.get(stack.url + "/ping").status_code == 200 and httpx.post(stack.url + "/ping").status_code == 200
    assert httpx.get(stack.url + "/version").json()["version"]
    max_len = httpx.get(stack.url + "/v1/models").json()["data"][0]["max_model_len"]
    r = httpx.post(stack.url + "/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()
    assert r == {"count": 6, "max_model_len": max_len, "tokens": tok.encode("Hello", add_special_tokens=True),
                 "token_strs": None}
    plain = httpx.post(stack.url + "/tokenize", json={"prompt": "Hé", "add_special_tokens": False,
                                                      "return_token_strs": True}).json()  # the only model
    assert plain["tokens"] == tok.encode("Hé") and len(plain["token_strs"]) == 3
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(stack.url + "/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages))
    back = httpx.post(stack.url + "/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello"}
    missing = httpx.post(stack.url + "/tokenize", json={"model": "gpt-4o", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["reason"] == "model_not_found"
    bad = httpx.post(stack.url + "/detokenize", json={"model": "tiny", "tokens": [1, -2]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_repetition_penalty_and_min_p_reach_the_worker(stack) -> None:
    def out(**extra) -> dict:
        body = {"model": "tiny", "prompt": [40, 41, 42, 40, 41, 42], "max_tokens": 16, "ignore_eos": True,
                "return_token_ids": True, **extra}
        return httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]

    greedy = out(temperature=0)
    hard = out(temperature=0, repetition_penalty=1e3)
    seen = {40, 41, 42}
    assert not (set(hard["token_ids"]) & seen) and len(set(hard["token_ids"])) == 16  # nothing seen comes back
    assert hard["token_ids"] != greedy["token_ids"] or not (set(greedy["token_ids"]) & seen)
    # min_p = 1 keeps only the most likely token: sampling at any temperature is then greedy
    assert out(temperature=1.5, min_p=1.0, seed=3)["token_ids"] == greedy["token_ids"]


def test_return_token_ids_and_stop_reason_as_vllm_sends_them(stack) -> None:
    body = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert free["prompt_token_ids"] == [9, 10, 11] and len(free["token_ids"]) == 12
    assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
    stop = free["token_ids"][5]
    got = httpx.post(stack.url + "/v1/completions", json={**body, "stop_token_ids": [stop]}, timeout=60).json()
    choice = got["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["token_ids"] == free["token_ids"][: free["token_ids"].index(stop) + 1]
    with httpx.stream("POST", stack.url + "/v1/completions", json={**body, "stop_token_ids": [stop], "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"] and chunks[0]["choices"][0]["prompt_token_ids"] == [9, 10, 11]
    assert all("stop_reason" in c["choices"][0] for c in chunks) and chunks[-1]["choices"][0]["stop_reason"] == stop
    chat = httpx.post(stack.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}, timeout=60).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    plain = httpx.post(stack.url + "/v1/completions", json={**body, "return_token_ids": False}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0]


def test_a_stream_sends_one_chunk_per_token_as_vllm_does(stack) -> None:
    """A token whose text is held back (an incomplete character, or the start of a stop string)
    still gets its chunk, with empty text, as vLLM's servers send it: a client timing chunks
    (vLLM's benchmark client does) sees every token when it was drawn."""
    body = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    held = next(ch for ch in whole["text"][:-1] if ch.isascii())  # a stop string's first character
    for extra in ({}, {"stop": [held + "\x00never"]}):
        for path in ("/v1/completions", "/v1/chat/completions"):
            ask = {**body, **extra}
            if path.endswith("chat/completions"):
                del ask["prompt"]
                ask["messages"] = [{"role": "user", "content": "hi"}]
            with httpx.stream("POST", stack.url + path, json={**ask, "stream": True}, timeout=60) as r:
                chunks = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
            per = [c["choices"][0] for c in chunks if "token_ids" in c["choices"][0]]
            assert [len(c["token_ids"]) for c in per] == [1] * 16, (path, extra)
            if path == "/v1/completions":
                assert "".join(c["text"] for c in per) == whole["text"]
                assert extra == {} or "" in [c["text"] for c in per]  # the held character's chunk had none


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("allowed_token_ids", [5, 6]),
                                         ("prompt_logprobs", 1), ("bad_words", ["x"]), ("length_penalty", 0.5),
                                         ("include_stop_str_in_output", True), ("truncate_prompt_tokens", 3)])
def test_a_vllm_parameter_kvpool_does_not_serve_is_a_400_naming_it(stack, field: str, value: object) -> None:
    r = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, field: value},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    ok = httpx.post(stack.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                         "user": "u1", "not_a_vllm_field": 1}, timeout=60)
    assert ok.status_code == 200  # a no-op field and a field neither API defines are accepted
