"""Helpers for the durability tests: Redis access, a journaling in-memory store, unique ids,
manager daemons, private redis-servers and the chaos clients that step on them.

Tests that need Redis use REDIS_URL (default redis://127.0.0.1:6379/0). When it cannot be
reached they skip, except under CI (env CI set), where they fail: CI must run them.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvpool.manager.config import ManagerConfig
from kvpool.manager.registry import Registry
from kvpool.manager.server import Server
from kvpool.manager.store.journal import encode_batch, recover
from kvpool.manager.store.state_file import dump_registry, encode_state
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.procs import free_port
from kvpool.shared.protocol import encode_request, unpack

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CHAOS = [sys.executable, str(Path(__file__).with_name("chaos_procs.py"))]
_ids = itertools.count(1000)


def redis_or_skip():
    """A redis-py client to REDIS_URL; skips (fails under CI) when it does not answer."""
    import redis

    r = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        r.ping()
    except redis.RedisError as e:
        if os.environ.get("CI"):
            pytest.fail(f"Redis at {REDIS_URL} is unreachable under CI ({e}): start redis-server")
        pytest.skip(f"no Redis at {REDIS_URL} ({e}); set REDIS_URL")
    return r


def new_namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def drop_namespace(r, ns: str) -> None:
    """The namespace's keys, and the high-water mark file a manager of it left on this host."""
    from kvpool.shared.bind import runtime_dir

    keys = list(r.scan_iter(f"kvpool:{{{ns}}}:*"))
    if keys:
        r.delete(*keys)
    mark = os.path.join(runtime_dir(), f"{ns}.seq")
    if os.path.exists(mark):
        os.unlink(mark)


def call(srv: Server, op: str, sid: str | None = None, now: float | None = None, msg_id: int | None = None,
         **args) -> dict:
    """One request through ``handle_payload`` with a fresh id (durable managers cache step ids)."""
    payload = encode_request(next(_ids) if msg_id is None else msg_id, op, sid, args)
    return unpack(srv.handle_payload(payload, time.monotonic() if now is None else now))


def pending(srv: Server, op: str, sid: str | None = None, **args):
    """One request handled from a peer's frames, its answer not yet encoded: the loop's commit
    (``Server._commit``) decides what it becomes."""
    payload = encode_request(next(_ids), op, sid, args)
    return srv.dispatcher.handle_frames([b"peer", payload], time.monotonic())


def dump_keys(r, ns: str) -> dict[bytes, bytes]:
    return {k: r.dump(k) for k in r.scan_iter(f"kvpool:{{{ns}}}:*")}


def put_back(r, ns: str, copy: dict[bytes, bytes]) -> None:
    """The namespace as it was when ``copy`` was taken (an operator restoring an older RDB)."""
    keys = list(r.scan_iter(f"kvpool:{{{ns}}}:*"))
    if keys:
        r.delete(*keys)
    for k, v in copy.items():
        r.restore(k, 0, v, replace=True)


def durable_server(endpoint: str = "ipc:///tmp/kvpool-unused.sock", store=None, **cfg) -> Server:
    """A Server whose store is loaded (it is active) or standing by."""
    srv = Server(ManagerConfig(endpoint=endpoint, **cfg), store=store)
    srv._activate(time.monotonic())
    return srv


def state_of(reg: Registry) -> dict:
    """Everything a store keeps, comparable with ==."""
    return dump_registry(reg, 0)


class CaptureStore:
    """A durable store kept in this process: a snapshot and journal batches, as Redis holds them."""

    durable = True

    def __init__(self) -> None:
        self.snap: bytes | None = None
        self.blobs: list[bytes] = []
        self.seq = 0

    def acquire(self) -> bool:
        return True

    def load(self, reg: Registry, now: float) -> bool:
        found = self.snap is not None
        if found:
            recover(reg, self.snap, self.blobs, self.seq, "capture", now)
        else:
            reg.rename(uuid.uuid4().hex)
            self.compact(reg)
        reg.mark_durable()
        return found

    def commit(self, reg: Registry, dirty: set[str]) -> None:
        log = reg.take_log()
        if log:
            self.seq += 1
            self.blobs.append(encode_batch(self.seq, log))

    def compact(self, reg: Registry) -> None:
        self.snap, self.blobs = encode_state(dump_registry(reg, self.seq)), []

    def stats(self) -> dict:
        return {"kind": "capture", "seq": self.seq}

    def shutdown(self, reg: Registry | None) -> None:
        pass

    def close(self) -> None:
        pass


def random_step(rng: random.Random, alive: list, next_rid: list, block_size: int = 4) -> list[dict]:
    """A step of frees, extends, forks and shared-prefix allocs (some invalid) for one client."""
    ops: list[dict] = []
    for rid in list(alive):
        roll = rng.random()
        if roll < 0.3:
            ops.append({"op": "free", "req": rid})
            alive.remove(rid)
        elif roll < 0.5:
            ops.append({"op": "extend", "req": rid, "num_tokens": 40 + rng.randint(0, 40)})
        elif roll < 0.55:
            child = next_rid[0]
            next_rid[0] += 1
            ops.append({"op": "fork", "req": rid, "child": child})
            alive.append(child)
    for _ in range(rng.randint(0, 3)):
        toks = list(range(100, 124)) + [rng.randrange(5000) for _ in range(rng.randint(1, 14))]
        ops.append({"op": "alloc", "req": next_rid[0], "hashes": hash_blocks(toks, block_size),
                    "prompt_len": len(toks), "max_new": len(toks), "lookahead": rng.randint(0, 2)})
        alive.append(next_rid[0])
        next_rid[0] += 1
    if rng.random() < 0.1:
        ops.append({"op": "free", "req": 10**9})  # unknown: an error result, nothing changes
    return ops


def settle(results: list[dict], ops: list[dict], alive: list) -> None:
    """Drops from ``alive`` the requests whose alloc/fork failed (no space, duplicates, ...)."""
    for op, res in zip(ops, results):
        if not res["ok"] and op["op"] in ("alloc", "fork"):
            rid = op["req"] if op["op"] == "alloc" else op["child"]
            if rid in alive:
                alive.remove(rid)
        if not res["ok"] and op["op"] == "extend" and res["code"] == "unknown_request" and op["req"] in alive:
            alive.remove(op["req"])


class Daemon:
    """`kvpool manager` processes on one endpoint and Redis namespace: start, SIGKILL, restart."""

    def __init__(self, spawn, sock_dir: str, namespace: str, *, name: str = "m", redis_url: str = REDIS_URL,
                 **cfg) -> None:
        from pathlib import Path

        self.spawn, self.endpoint = spawn, f"ipc://{sock_dir}/{name}.sock"
        values = {"endpoint": self.endpoint, "redis_url": redis_url, "namespace": namespace,
                  "session_timeout_s": 30.0, "lease_ms": 1000, "redis_timeout_s": 0.5, **cfg}
        lines = ["[manager]"] + [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in values.items()]
        self.config = Path(sock_dir) / f"{name}.toml"
        self.config.write_text("\n".join(lines).replace("'", '"') + "\n")
        self.proc = None

    def start(self, log: Path | None = None):
        """Starts the daemon; ``log``: its stderr (the log) appended to that file, to read what it
        reported (``logged``), else to the test's stderr."""
        from helpers.manager import CLI

        err = open(log, "a") if log is not None else None  # noqa: SIM115 - the child holds it
        try:
            self.proc = self.spawn([*CLI, "manager", "--config", str(self.config)], stdout=None, stderr=err)
        finally:
            if err is not None:
                err.close()
        return self.proc

    def kill(self) -> None:
        import signal

        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait_active(self, timeout: float = 30.0) -> float:
        """Seconds until the manager answers as the active one (not a standby)."""
        from kvpool.client.manager import ManagerClient, ManagerError

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, f"the manager exited with {self.proc.returncode}"
            with ManagerClient(self.endpoint, role="admin", timeout_s=0.3, failover_s=0.0) as c:
                try:
                    c.hello()
                    return time.monotonic() - t0
                except ManagerError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"the manager at {self.endpoint} did not become active in {timeout}s")


class LeaseWatch:
    """Watches a namespace's lease from a thread, on Redis's own clock: one script reads the
    holder, the fencing token, the lease's remaining time and Redis's TIME at once, so what a
    test asserts about the lease (who held it from when, when it would lapse) never depends on
    how promptly the test itself was scheduled. ``first_seen[(holder, token)]``: the Redis time
    that holding was first read (never before it began; at most one poll after it did)."""

    SCRIPT = ("local t = redis.call('TIME') return {redis.call('GET', KEYS[1]) or '', "
              "redis.call('GET', KEYS[2]) or '', redis.call('PTTL', KEYS[1]), t[1], t[2]}")

    def __init__(self, r, namespace: str, every_s: float = 0.01) -> None:
        import threading

        self.r, self.every_s = r, every_s
        self.keys = [f"kvpool:{{{namespace}}}:lease", f"kvpool:{{{namespace}}}:fence"]
        self.first_seen: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-watch", daemon=True)
        self._thread.start()

    def read(self) -> tuple[str, str, float, float]:
        """(holder, fencing token, seconds until the lease lapses (< 0: none), Redis time)."""
        holder, token, pttl, sec, usec = self.r.eval(self.SCRIPT, 2, *self.keys)
        now = int(sec) + int(usec) / 1e6
        seen = (holder.decode(), token.decode())
        if holder:
            self.first_seen.setdefault(seen, now)
        return seen[0], seen[1], int(pttl) / 1000, now

    def holding(self, endpoint: str) -> tuple[str, float] | None:
        """The latest (token, first seen) of the manager at ``endpoint`` holding the lease."""
        mine = [(t, at) for (h, t), at in list(self.first_seen.items()) if h.endswith(endpoint)]
        return max(mine, key=lambda m: m[1]) if mine else None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def logged(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text(errors="replace")


def redis_server(spawn, directory: str, *extra: str, port: int | None = None):
    """A private redis-server on a free 127.0.0.1 port (killed by ``spawn``'s fixture); (proc, port).
    A port taken between choosing and binding it (other tests run beside) means another try."""
    import shutil
    import subprocess

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("needs redis-server and redis-cli on PATH")
    for _ in range(5):
        use = port or free_port()
        cmd = ["redis-server", "--port", str(use), "--bind", "127.0.0.1", "--dir", directory, "--save", "",
               "--appendonly", "no", *extra]
        proc = spawn(cmd, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            ping = subprocess.run(["redis-cli", "-p", str(use), "ping"], capture_output=True)
            if ping.stdout.strip() == b"PONG":
                return proc, use
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
    raise AssertionError(f"redis-server would not start in {directory} ({' '.join(extra)})")


def chaos_clients(spawn, endpoint: str, stop: Path, n: int, *check_every: str) -> list[subprocess.Popen]:
    """``n`` chaos clients (chaos_procs.py, seeds 0..n-1) stepping on pool "chaos" until ``stop``
    exists; ``check_every`` ("1": compare views after every step) else chaos_procs' default."""
    return [spawn([*CHAOS, endpoint, "chaos", str(seed), str(stop), *check_every], stderr=subprocess.STDOUT)
            for seed in range(n)]


def finish_chaos_clients(clients: list[subprocess.Popen], stop: Path) -> list[dict]:
    """Stops the chaos clients and returns each one's last report (a JSON line). A client exits
    non-zero when its view of its blocks differed from the manager's without being told."""
    stop.touch()
    outs = []
    for c in clients:
        out, _ = c.communicate(timeout=120)
        assert c.returncode == 0, out  # no client's view ever differed from the manager's untold
        outs.append(json.loads(out.splitlines()[-1]))
    return outs


def seed_big_state(namespace: str, blocks: int, redis_url: str = REDIS_URL) -> None:
    """Writes a state with one pool of ``blocks`` blocks into ``namespace`` (a clean stop), so a
    manager takes a while to load it."""
    from helpers.manager import SPEC
    from kvpool.manager.store.redis_store import RedisStore
    from kvpool.manager.store.redis_url import connect
    from kvpool.shared.protocol import KVSpec

    store = RedisStore(connect(redis_url, 30.0), namespace, owner="seeder", lease_ms=60_000)
    reg = Registry("seeder", session_timeout_s=60.0, max_blocks=blocks)
    if not store.acquire():
        raise AssertionError(f"namespace {namespace} is leased")
    store.load(reg, 0.0)
    sess = reg.open_session("seeder", "worker", False, 1, 0.0)
    reg.register(sess, "big", 0, 1, "i", KVSpec.from_wire(SPEC), blocks * KVSpec.from_wire(SPEC).block_bytes)
    store.commit(reg, set())
    store.shutdown(reg)
    store.close()
