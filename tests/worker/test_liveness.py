"""The generate service's liveness, in process over a real ipc socket: heartbeats, clients that
go away, back-off while the manager drains, and the client's causes (client/generate.py)."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
from helpers.worker import make_engine, make_prompt

from kvpool.client.generate import GenerateClient, WorkerUnavailable
from kvpool.worker.server import WorkerServer


class Serving:
    """A WorkerServer whose loop runs in a thread (signal handlers need the main thread)."""

    def __init__(self, engine) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvp-")
        self.endpoint = f"ipc://{self.dir}/w.sock"
        self.server = WorkerServer(engine, self.endpoint, "p")
        self.steps = 0
        step = engine.step

        def counting_step():
            self.steps += 1
            return step()

        engine.step = counting_step
        self.server._sock.bind(self.endpoint)
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop:
            self.server.run_once()

    def stop(self) -> None:
        self._stop = True
        self.thread.join(10)
        if self.server._sock.closed:  # "killed" by the test
            self.server._ctx.term()
        else:
            self.server.shutdown()


@pytest.fixture
def serving():
    started = []

    def start(**kw) -> Serving:
        started.append(Serving(make_engine(**kw)))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_client_that_goes_away_has_its_request_aborted(serving):
    s = serving(max_model_len=2048)
    client = GenerateClient(s.endpoint)
    client.submit(make_prompt(30, 0), max_tokens=2000, ignore_eos=True)
    assert client.recv(10) is not None  # generating
    client.sock.close(linger=0)  # gone without an abort (a killed process)
    wait_for(lambda: not s.server.engine.has_work())
    assert s.server._clients == {} and s.server.engine.scheduler.stats.computed_tokens < 1500
    client.close()


def test_draining_backs_off_heartbeats_say_why_and_the_client_gives_up(serving):
    s = serving()
    s.server.engine.bm.draining = True
    client = GenerateClient(s.endpoint)
    try:
        rid = client.submit(make_prompt(20, 1), max_tokens=4)
        beat = client.recv(5)
        assert beat == {"id": rid, "heartbeat": True, "finished": False, "waiting": "draining"}
        steps0, t0 = s.steps, time.monotonic()
        time.sleep(2.0)
        assert s.steps - steps0 <= 8, f"{s.steps - steps0} steps in {time.monotonic() - t0:.1f}s while draining"
        with pytest.raises(WorkerUnavailable) as e:
            list(client.stream(make_prompt(20, 2), max_tokens=4))
        assert e.value.cause == "draining" and "kvpool drain --cancel" in str(e.value)
        wait_for(lambda: len(s.server.engine.scheduler.waiting) == 1)  # the client's abort arrived
        client.send("abort", id=rid)
        wait_for(lambda: not s.server.engine.has_work())
        s.server.engine.bm.draining = False  # the drain ends: nothing abandoned runs
        time.sleep(0.3)
        assert s.server.engine.scheduler.stats.prompt_tokens == 0
    finally:
        client.close()


def test_the_client_names_a_missing_or_stale_socket_and_a_worker_that_died(serving):
    d = tempfile.mkdtemp(prefix="kvp-")
    client = GenerateClient(f"ipc://{d}/none.sock")
    with pytest.raises(WorkerUnavailable) as e:
        list(client.stream([5, 6], max_tokens=2))
    assert e.value.cause == "no_socket"
    client.close()
    open(os.path.join(d, "stale.sock"), "w").close()  # a file nobody listens on
    client = GenerateClient(f"ipc://{d}/stale.sock", connect_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailable) as e:
        list(client.stream([5, 6], max_tokens=2))
    assert e.value.cause == "not_listening" and time.monotonic() - t0 < 3
    client.close()
    s = serving(max_model_len=2048)
    client = GenerateClient(s.endpoint)
    stream = client.stream(make_prompt(30, 3), max_tokens=2000, ignore_eos=True)
    next(stream)
    s._stop = True
    s.thread.join(10)
    s.server._sock.close(linger=0)  # the worker's connection closes, as when its process dies
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailable) as e:
        list(stream)
    assert e.value.cause == "gone" and time.monotonic() - t0 < 5
    client.close()


def test_a_client_timeout_aborts_the_request_on_the_worker(serving):
    s = serving(max_model_len=2048)
    client = GenerateClient(s.endpoint)
    try:
        with pytest.raises(WorkerUnavailable) as e:
            list(client.stream(make_prompt(30, 4), timeout_s=0.3, max_tokens=2000, ignore_eos=True))
        assert e.value.cause == "timeout"
        wait_for(lambda: not s.server.engine.has_work())
    finally:
        client.close()


def test_claiming_an_endpoint_removes_a_stale_file_and_refuses_a_live_worker(serving):
    from kvpool.worker.endpoint import EndpointInUse, claim

    d = tempfile.mkdtemp(prefix="kvp-")
    stale = os.path.join(d, "w.sock")
    open(stale, "w").close()
    assert claim(f"ipc://{stale}", "p", replace=False) == "stale" and not os.path.exists(stale)
    assert claim(f"ipc://{stale}", "p", replace=False) == "absent"
    s = serving()
    with pytest.raises(EndpointInUse, match="a live worker \\(pool 'p'\\) already serves"):
        claim(s.endpoint, "p", replace=False)
    assert claim(s.endpoint, "p", replace=True) == "serving" and not os.path.exists(s.endpoint[6:])


def test_a_worker_that_cannot_reach_its_manager_is_reported_within_seconds(serving):
    # as RemoteBlockManager behaves: a step without a reply gives the session up (ManagerReset),
    # then re-registering finds no manager (ManagerUnavailable) until it is back
    from kvpool.shared.protocol import ManagerUnavailable
    from kvpool.worker.block_manager import ManagerReset

    s = serving()
    bm = s.server.engine.bm

    def lost(ops):
        raise ManagerReset("unavailable: no reply to 'step'")

    def unreachable(spec, available, host_kv_bytes=0, host_kv_policy="demote"):
        time.sleep(0.2)  # as a call that times out, shortened
        raise ManagerUnavailable("no reply to 'hello'")

    bm.step, bm.register, bm.heartbeat = lost, unreachable, lambda: False
    client = GenerateClient(s.endpoint, manager_grace_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable) as e:
            list(client.stream(make_prompt(20, 5), max_tokens=4))
        assert e.value.cause == "manager_unreachable" and "cannot reach its manager" in str(e.value)
        assert time.monotonic() - t0 < 5
    finally:
        client.close()


def test_a_worker_that_stops_answering_is_reported_silent(serving):
    s = serving()
    s._stop = True  # the loop stops (a paused or wedged worker); its socket stays open
    s.thread.join(10)
    client = GenerateClient(s.endpoint, liveness_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable) as e:
            list(client.stream(make_prompt(20, 6), max_tokens=4))
        assert e.value.cause == "silent" and 1.0 <= time.monotonic() - t0 < 4
    finally:
        client.close()


def test_a_refusal_of_n_0_reaches_the_client(serving):
    s = serving()
    client = GenerateClient(s.endpoint)
    try:
        with pytest.raises(ValueError, match="the worker refused the request"):
            list(client.stream(make_prompt(20, 7), max_tokens=4, n=0))
    finally:
        client.close()


def test_a_manager_that_answers_again_is_no_longer_reported_down():
    engine = make_engine()
    server = WorkerServer(engine, "inproc://unused", "p")
    try:
        server._manager_down = "unavailable: no reply"  # a heartbeat failed while the worker idled
        server.run_once()  # the next heartbeat is answered (in-process manager)
        assert server._manager_down is None and server._waiting_reason() is None
    finally:
        server._sock.close()
        server._ctx.term()
