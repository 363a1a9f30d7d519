"""An engine over a real manager (a server thread): losing the manager counts as one reset."""

from __future__ import annotations

import tempfile
import threading
import time

from helpers.worker import BLOCK_BYTES, greedy, make_prompt

from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.protocol import ManagerUnavailable
from kvpool.worker.block_manager import RemoteBlockManager
from kvpool.worker.config import WorkerConfig
from kvpool.worker.startup import build_engine


def start_server(endpoint: str) -> tuple[Server, threading.Thread]:
    srv = Server(ManagerConfig(endpoint=endpoint))
    srv.bind()
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    return srv, thread


def stop(srv: Server, thread: threading.Thread) -> None:
    srv.request_stop()
    thread.join(10)


def test_a_step_lost_with_the_manager_then_a_heartbeat_to_its_successor_is_one_reset():
    # test_serving's manager restart under load: the free step that followed a request was in
    # flight when the manager died (a timeout: reset 1), then the idle heartbeat reached the new
    # manager with the old session, which found it gone again (reset 2).
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvp-')}/m.sock"
    srv, thread = start_server(endpoint)
    cfg = WorkerConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory=64 * BLOCK_BYTES,
                       max_model_len=128)
    bm = RemoteBlockManager(endpoint, "p", timeout_s=1.0)
    engine = build_engine(cfg, bm)
    try:
        engine.add_request(make_prompt(20, 0), greedy(3))
        while engine.scheduler.running or engine.scheduler.waiting:
            engine.step()
        assert engine.scheduler.pending_frees  # the free goes with the next step
        stop(srv, thread)
        for _ in range(3):  # the step that sends it gets no reply: the manager may or may not have run it
            engine.step()   # (the step right after a finish may only run what it holds, sending nothing)
            if not engine.scheduler.pending_frees:
                break
        assert engine.resets == 1
        srv, thread = start_server(endpoint)
        bm.client.heartbeat_interval_s = 0.0  # a heartbeat is due now, as the idle loop's would be
        engine.heartbeat()
        assert engine.resets == 1
        rid = engine.add_request(make_prompt(20, 1), greedy(3))
        out = []
        while engine.has_work():
            try:
                out += [ev.token for ev in engine.step() if ev.request_id == rid]
            except ManagerUnavailable:  # the new manager is still starting: the serving loop retries
                time.sleep(0.1)
        assert len(out) == 3 and engine.resets == 1 and engine.registrations == 2
    finally:
        engine.shutdown()
        bm.close()
        stop(srv, thread)
