"""A real worker process under >= 10,000 hostile generate-socket messages (slow).

Every hostile message is invalid in one way (not msgpack, not a map, a wrong type or range in
one field, deep nesting, unknown params) and must get exactly one error reply; a flood of
messages nobody reads follows. Throughout, a well-behaved client's requests are served with the
reference model's tokens, and at the end the worker is alive, idle, and stops cleanly.
"""

from __future__ import annotations

import random
import signal

import msgpack
import pytest
import torch
import zmq
from helpers.worker import make_prompt
from helpers.worker_procs import Cluster, ClusterConfig

from kvpool.client.generate import GenerateClient
from kvpool.worker.config import PRESETS
from kvpool.worker.model import build_model
from kvpool.worker.reference import reference_generate

pytestmark = pytest.mark.slow

VOCAB = PRESETS["tiny"].vocab_size
MAX_MODEL_LEN = 512  # ClusterConfig's
NAN, INF = float("nan"), float("inf")
COMMON_BAD = [None, [], {}, [[]], {"a": {}}, b"\x00", "x" * 3000]
BAD = {  # per field: values that field must refuse (the others in the message are valid)
    "op": [1, "", "GENERATE", "shutdown", True, *COMMON_BAD],
    "id": [1.5, "", "x" * 200, True, *COMMON_BAD],
    "prompt": ["abc", [1.0], [-1], [VOCAB], [1 << 63], [True], [None], [[5]], list(range(2, MAX_MODEL_LEN + 2)),
               *COMMON_BAD],
    "params": ["p", 7, [1, 2], True, 1.5],
    "cache_salt": ["", "x" * 300, 5, True, 1.5, [], {}, b"\x00"],
    "max_tokens": [0, -1, 1.5, "1", True, 1 << 31, NAN, *COMMON_BAD],
    "temperature": [-1, -0.5, NAN, INF, -INF, "1", True, 1e5, *COMMON_BAD],
    "top_p": [0, -1, 1.5, NAN, INF, "1", True, *COMMON_BAD],
    "seed": [-1, -(1 << 62), 1.5, "x", True, 1 << 63, NAN, [], {}, b"\x00"],
    "n": [0, 65, 2.5, "2", True, -(1 << 63), *COMMON_BAD],
    "ignore_eos": [0, 1, "yes", 1.0, *COMMON_BAD],
    "top_k": [-1, 1.5, "1", True, NAN, *COMMON_BAD],
    "min_tokens": [-1, 3, 1.5, "1", True, *COMMON_BAD],  # 3 > the message's max_tokens
    "presence_penalty": [3, -2.5, NAN, INF, "1", True, *COMMON_BAD],
    "frequency_penalty": [3, -2.5, NAN, -INF, "1", True, *COMMON_BAD],
    "logprobs": [-1, 21, 1.5, "1", True, [], {}, b"\x00"],
    "stop_token_ids": [5, [-1], [True], [1.5], [None], "x", [0] * 257, {}, None, b"\x00", [[]]],
    "stop": ["x", ["y"], None],  # stop strings are text: the front door's, never a wire param
}
PARAMS = ("max_tokens", "temperature", "top_p", "seed", "n", "ignore_eos", "top_k", "min_tokens", "presence_penalty",
          "frequency_penalty", "logprobs", "stop_token_ids", "stop")


def deep(levels: int) -> list:
    v: list = []
    for _ in range(levels):
        v = [v]
    return v


def hostile(rng: random.Random) -> bytes:
    """One invalid message."""
    kind = rng.randrange(10)
    if kind == 0:  # random bytes: not msgpack, or not a map
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    if kind == 1:  # msgpack, but not a map
        return msgpack.packb(rng.choice([1, -5, "generate", [1, 2], None, True, 1.5, b"\x01", deep(50)]))
    if kind == 2:  # nested far too deep, in a field the worker reads
        where = rng.choice(["prompt", "params", "id"])
        return msgpack.packb({"op": "generate", "id": "h", "prompt": [5], where: deep(rng.choice([5, 100, 500]))})
    msg = {"op": "generate", "id": f"h{rng.randrange(1000)}", "prompt": make_prompt(rng.randrange(1, 40), rng.random()),
           "params": {"max_tokens": 2}}
    field = rng.choice([*BAD, *PARAMS])
    value = rng.choice(BAD[field])
    if field in PARAMS:
        msg["params"][field] = value
    else:
        msg[field] = value
    return msgpack.packb(msg, use_bin_type=True)


@pytest.fixture(scope="module")
def model():
    return build_model(PRESETS["tiny"], torch.float32, "cpu", seed=0)  # the worker's weights


def served_correctly(client: GenerateClient, model, rng: random.Random) -> None:
    prompt = make_prompt(rng.randrange(3, 60), rng.random())
    n = rng.choice([1, 2])
    outs: dict[int, list[int]] = {}
    for msg in client.stream(prompt, timeout_s=30, max_tokens=4, n=n, ignore_eos=True):
        if msg.token is not None:
            outs.setdefault(msg.index, []).append(msg.token)
    assert [outs[i] for i in range(n)] == [reference_generate(model, prompt, 4)] * n


def test_worker_survives_hostile_messages_and_serves_a_good_client_throughout(model):
    cluster = Cluster(ClusterConfig(num_workers=1))
    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    try:
        cluster.start()
        worker = cluster.workers[0]
        evil.connect(cluster.worker_eps[0])
        good = GenerateClient(cluster.worker_eps[0])
        rng = random.Random(13)
        sent = 0
        for _ in range(20):  # 20 rounds of 500 invalid messages, a good request after each
            for _ in range(500):
                evil.send(hostile(rng))
            for _ in range(500):
                assert evil.poll(30_000), f"no reply to a hostile message after {sent}"
                reply = msgpack.unpackb(evil.recv(), raw=False)
                assert reply.get("finished") is True and "error" in reply, reply
            sent += 500
            assert worker.poll() is None, cluster.log_tail(worker)
            served_correctly(good, model, rng)
        assert not evil.poll(200), "one reply per message, no more"
        for _ in range(5000):  # a flood nobody reads
            evil.send(msgpack.packb({"op": "ping", "id": "flood"}))
        for _ in range(3):
            served_correctly(good, model, rng)
        stats = good.call("stats")["stats"]
        assert worker.poll() is None and stats["running"] == 0 and stats["waiting"] == 0
        good.close()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, cluster.log_tail(worker)
        log = cluster.log_tail(worker, 1 << 22)
        assert "Traceback" not in log
        assert log.count("is not reading") <= 3, "a flooding client must not flood the worker's log"
    finally:
        evil.close()
        ctx.term()
        cluster.stop()
