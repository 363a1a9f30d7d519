"""External pools: vLLM servers whose KV events the manager mirrors (``kvpool attach``).

A thread of its own owns every socket of the feed, so decoding events and serving replays never
stall the manager's loop:

- one SUB socket, bound at ``vllm_events_endpoint`` (vLLM's publisher *connects* to a plain
  ``tcp://HOST:PORT``: the manager binds, the "centralized" layout), and connected to the
  endpoints of attached servers that bind their own (``ipc://``, ``tcp://*:PORT``);
- per attached server with a replay endpoint, a DEALER socket to vLLM's replay ROUTER.

Batches are routed by topic (each attached server publishes on its own) to that server's
``Mirror`` (manager/external/mirror.py), under a lock that the loop's ``locate`` takes too.
A second thread (manager/external/probe.py) polls each server's ``/metrics``: its load for the
``externals`` rows, and the silence rule (manager/external/silence.py) that marks a mirror stale
when the server computes blocks and no batch comes.
The loop calls ``attach``/``detach``/``rows``/``locate``: thread-safe, applied by the feed at
its next turn (within POLL_MS).
"""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import zmq

from kvpool.manager.events import END_SEQ, decode_batch
from kvpool.manager.external.mirror import DEVICE, Mirror
from kvpool.manager.external.probe import Probe, ServerLoad
from kvpool.manager.external.silence import SilenceWatch
from kvpool.manager.state.attachment import Attachment, check_endpoint, check_url

logger = logging.getLogger(__name__)
POLL_MS = 50
END = END_SEQ.to_bytes(8, "big")  # a replay's end marker (vLLM's: -1 as 8 signed bytes)
REPLAY_TIMEOUT_S = 5.0  # a replay not ended by then ends as it is (what it did not send is lost)
POLL_S = 1.0  # each server's /metrics is read this often (0: never)
WINDOW_S = 10.0  # computed blocks with no batch within this long: its events stopped


class _Server:
    """One attachment's feed state (the feed thread's own)."""

    def __init__(self, spec: Attachment, window_s: float) -> None:
        self.spec = spec
        self.mirror = Mirror(spec.name, spec.block_size)
        self.replay_sock: zmq.Socket | None = None
        self.replay_deadline = 0.0
        self.last_event: float | None = None  # monotonic time of its last live batch
        self.watch = SilenceWatch(spec.block_size, window_s)
        self.load: ServerLoad | None = None  # its latest /metrics answer
        self.http_error: str | None = None  # why its latest /metrics poll got no answer


class ExternalFeed:
    def __init__(self, ctx: zmq.Context, bind: str | None = None, poll_s: float = POLL_S,
                 window_s: float = WINDOW_S) -> None:
        self.ctx = ctx
        self.bind = bind
        self.window_s = window_s
        self._lock = threading.Lock()  # guards the mirrors and the commands
        self._commands: list[tuple[str, object]] = []
        self._servers: dict[str, _Server] = {}  # by name; the thread adds and removes
        self._specs: dict[str, Attachment] = {}  # by name, as the loop sees them (attach/detach at once)
        self._stop = threading.Event()
        self.bound: str | None = None
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self._sub.bind(bind)
            self.bound = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kvpool-external-feed", daemon=True)
        self._thread.start()
        self._probe = Probe(self._targets, self._report, poll_s) if poll_s > 0 else None

    # -- the loop's side -------------------------------------------------------------------

    def attach(self, spec: Attachment) -> None:
        """Raises ValueError for a name or topic already attached."""
        with self._lock:
            for other in self._specs.values():
                if other.name == spec.name:
                    raise ValueError(f"an external pool named {spec.name!r} is attached already: detach it first")
                if other.topic == spec.topic:
                    raise ValueError(f"external pool {other.name!r} publishes on topic {spec.topic!r} already: "
                                     "give each server its own topic (kv-events-config \"topic\")")
            self._specs[spec.name] = spec
            self._commands.append(("attach", spec))

    def detach(self, name: str) -> bool:
        with self._lock:
            if self._specs.pop(name, None) is None:
                return False
            self._commands.append(("detach", name))
            return True

    def names(self) -> list[str]:
        with self._lock:
            return list(self._specs)

    def specs(self) -> dict[str, Attachment]:
        with self._lock:
            return dict(self._specs)

    def locate(self, hashes: list[bytes]) -> dict[str, tuple[int, int]]:
        """{external pool: (leading blocks of ``hashes`` its device tier holds, the blocks after
        those in its CPU tier)}, stale ones left out."""
        with self._lock:
            return {name: s.mirror.lookup_tiers(hashes) for name, s in self._servers.items()
                    if s.mirror.stale is None}

    def rows(self) -> list[dict]:
        now = time.monotonic()
        with self._lock:
            out = []
            for name, spec in self._specs.items():
                s = self._servers.get(name)
                row = {**spec.to_wire(), "stale": "not subscribed yet", "blocks": {}}
                if s is not None:
                    row.update(s.mirror.summary())
                    row["idle_s"] = round(now - s.last_event, 3) if s.last_event is not None else None
                    row["http"] = s.http_error  # None: its /metrics answered at the last poll
                    if s.load is not None:  # its own figures (the front door weighs them)
                        row.update(s.load.to_wire(), load_age_s=round(now - s.load.at, 3))
                out.append(row)
            return out

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the probe's side ------------------------------------------------------------------

    def _targets(self) -> dict[str, str]:
        with self._lock:
            return {name: s.spec.url for name, s in self._servers.items()}

    def _report(self, name: str, load: ServerLoad | None, error: str | None) -> None:
        with self._lock:
            s = self._servers.get(name)
            if s is None:
                return  # detached meanwhile
            if load is None:
                if s.http_error is None:
                    logger.warning("external pool %s: its /metrics did not answer: %s", name, error)
                s.http_error = error or "no answer"
                return
            s.http_error, s.load = None, load
            why = s.watch.observe(load, s.last_event)
            if why is not None:
                logger.warning("external pool %s: %s; its mirror is stale until rebuilt", name, why)
                s.mirror.silenced(why)

    # -- the feed thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._run_commands(poller)
                ready = dict(poller.poll(POLL_MS))
                if self._sub in ready:
                    self._read_live()
                for s in list(self._servers.values()):
                    if s.replay_sock is not None and s.replay_sock in ready:
                        self._read_replay(s)
                    if s.mirror.replaying is not None and time.monotonic() > s.replay_deadline:
                        logger.warning("external pool %s: the replay did not end in %.0f s", s.spec.name,
                                       REPLAY_TIMEOUT_S)
                        self._end_replay(s)
        except Exception:  # the feed must not die silently: its pools go stale and say why
            logger.exception("the external-pool feed stopped")
            with self._lock:
                for s in self._servers.values():
                    s.mirror.fail("the manager's event feed stopped (logged)")
        finally:
            for s in self._servers.values():
                if s.replay_sock is not None:
                    s.replay_sock.close(linger=0)
            self._sub.close(linger=0)

    def _run_commands(self, poller: zmq.Poller) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for kind, arg in commands:
            if kind == "attach":
                spec = arg
                assert isinstance(spec, Attachment)
                s = _Server(spec, self.window_s)
                if spec.events:
                    self._sub.connect(spec.events)
                if spec.replay:
                    s.replay_sock = self.ctx.socket(zmq.DEALER)
                    s.replay_sock.setsockopt(zmq.LINGER, 0)
                    s.replay_sock.connect(spec.replay)
                    poller.register(s.replay_sock, zmq.POLLIN)
                with self._lock:
                    self._servers[spec.name] = s
                logger.info("external pool %s attached: %s (model %s, events on topic %r%s)", spec.name, spec.url,
                            spec.model, spec.topic, f", replay {spec.replay}" if spec.replay else "")
            else:
                with self._lock:
                    s = self._servers.pop(str(arg), None)
                if s is None:
                    continue
                if s.spec.events:
                    try:
                        self._sub.disconnect(s.spec.events)
                    except zmq.ZMQError:
                        pass
                if s.replay_sock is not None:
                    poller.unregister(s.replay_sock)
                    s.replay_sock.close(linger=0)
                logger.info("external pool %s detached", s.spec.name)

    def _server_of(self, topic: bytes) -> _Server | None:
        name = topic.decode("utf-8", "replace")
        for s in self._servers.values():
            if s.spec.topic == name:
                return s
        return None

    def _read_live(self) -> None:
        for _ in range(1000):  # a bounded slice: commands and replays get their turn
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            s = self._server_of(frames[0])
            if s is None:
                continue  # a topic nobody attached
            seq = int.from_bytes(frames[1], "big")
            events = self._decode(s, frames[2])
            with self._lock:
                s.last_event = time.monotonic()
                if events is None:
                    s.mirror.undecodable()
                    continue
                start = self._guard(s, s.mirror.live, seq, events)
            if start is not None:
                self._ask_replay(s, start)

    def _decode(self, s: _Server, payload: bytes) -> list[dict] | None:
        try:
            return decode_batch(payload).events
        except (ValueError, msgpack.UnpackException, TypeError) as e:
            logger.warning("external pool %s: a batch did not decode: %s", s.spec.name, e)
            return None

    def _guard(self, s: _Server, apply, *args):
        """Applies under the lock held by the caller; a batch that breaks the mirror makes it stale."""
        try:
            return apply(*args)
        except Exception as e:  # hostile or unexpected fields (a token id out of range, ...)
            logger.warning("external pool %s: a batch could not be applied: %s", s.spec.name, e)
            s.mirror.undecodable()
            return None

    def _ask_replay(self, s: _Server, start: int) -> None:
        if s.replay_sock is None:
            logger.warning("external pool %s: batches from %d were missed and it has no replay endpoint",
                           s.spec.name, start)
            with self._lock:
                self._guard(s, s.mirror.replay_done)
            return
        s.replay_sock.send_multipart([b"", start.to_bytes(8, "big")])
        s.replay_deadline = time.monotonic() + REPLAY_TIMEOUT_S
        logger.info("external pool %s: replay asked from batch %d", s.spec.name, start)

    def _read_replay(self, s: _Server) -> None:
        assert s.replay_sock is not None
        while True:
            try:
                frames = s.replay_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            if frames[1] == END:
                self._end_replay(s)
                continue
            if s.mirror.replaying is None:
                continue  # a late answer to a replay given up on
            seq = int.from_bytes(frames[1], "big")
            events = self._decode(s, frames[2])
            with self._lock:
                if events is None:
                    s.mirror.undecodable()
                else:
                    self._guard(s, s.mirror.replayed, seq, events)

    def _end_replay(self, s: _Server) -> None:
        with self._lock:
            if s.mirror.replaying is not None:
                self._guard(s, s.mirror.replay_done)


__all__ = ["DEVICE", "Attachment", "ExternalFeed", "check_endpoint", "check_url"]
