"""The registry's whole state as one checksummed msgpack blob, and back (pure, no I/O).

A state snapshot is what a Redis store keeps under its ``snap`` key and what ``kvpool snapshot``
writes to a file: sessions (with their last step's reply, for retried steps), pools with their
shards, epochs and ``manager/core/snapshot.py`` pool dumps, the draining flag, the state id and
``seq``, the number of the last journal batch (manager/store/journal.py) the snapshot includes.

Layout: ``MAGIC (12 bytes) || SHA-256(payload) (32 bytes) || payload (msgpack map)``. Decoding
checks the magic, the checksum, the format and every field: anything else raises
``CorruptState`` naming what is wrong, and nothing is half-loaded into the registry (it is
filled only once every part decoded). The caller checks the invariants of the whole registry
(``Registry.check_invariants``) before anything uses it.
"""

from __future__ import annotations

import hashlib

from kvpool.manager.core.snapshot import CorruptState, dump_pool, load_pool
from kvpool.manager.state.attachment import Attachment
from kvpool.manager.state.entries import PoolEntry, Session, Shard
from kvpool.manager.store.view import StateView
from kvpool.shared.protocol import HOST_POLICIES, KVSpec, ManagerError, pack, unpack

MAGIC = b"KVPOOL-STATE"
FORMAT = 1
_HEAD = len(MAGIC) + 32


def dump_registry(reg: StateView, seq: int) -> dict:
    sessions = [[s.sid, s.num, s.identity, s.role, s.admin, s.version, s.last_step_id, s.last_step]
                for s in reg.sessions.values()]
    pools = []
    for e in reg.pools.values():
        shards = [_shard_row(s) for s in e.shards.values()]
        pools.append([e.name, e.shard_count, e.epoch, shards, dump_pool(e.pool) if e.pool is not None else None])
    d = {"format": FORMAT, "state_id": reg.state_id, "seq": seq, "next_num": reg.next_num,
         "draining": reg.draining, "sessions": sessions, "pools": pools}
    if reg.attachments:  # (absent in snapshots from before external pools were kept)
        d["attach"] = [a.to_wire() for a in reg.attachments.values()]
    return d


def encode_state(d: dict) -> bytes:
    payload = pack(d)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode_state(data: bytes, what: str = "state snapshot") -> dict:
    """The snapshot map; CorruptState when the bytes are not a whole, intact snapshot."""
    if type(data) is not bytes or len(data) < _HEAD or not data.startswith(MAGIC):
        raise CorruptState(f"{what}: not a kvpool state snapshot (bad magic or truncated)")
    payload = data[_HEAD:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC):_HEAD]:
        raise CorruptState(f"{what}: checksum mismatch ({len(data)} bytes): truncated or corrupted")
    try:
        d = unpack(payload)
    except Exception as e:
        raise CorruptState(f"{what}: payload is not msgpack: {e}") from None
    if type(d) is not dict or d.get("format") != FORMAT:
        raise CorruptState(f"{what}: format {d.get('format') if type(d) is dict else None!r}, expected {FORMAT}")
    return d


def load_registry(d: dict, reg: StateView, now: float) -> int:
    """Fills the empty ``reg`` from ``dump_registry`` output; returns the snapshot's seq.

    Sessions get ``last_seen = now``: every client has a full session timeout to come back.
    """
    try:
        sessions, pools = _sessions(d["sessions"], now), [_pool(p) for p in d["pools"]]
        attachments = [Attachment.from_wire(a) for a in d.get("attach", [])]
        state_id, seq, next_num, draining = d["state_id"], d["seq"], d["next_num"], d["draining"]
        if type(state_id) is not str or type(seq) is not int or type(next_num) is not int:
            raise TypeError("state_id, seq or next_num has the wrong type")
    except CorruptState:
        raise
    except ManagerError as e:
        raise CorruptState(f"state snapshot: an attachment: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptState(f"state snapshot is not loadable: {type(e).__name__}: {e}") from None
    reg.restore(sessions, pools, state_id, next_num, bool(draining), attachments)
    return seq


def _sessions(rows: list, now: float) -> list[Session]:
    out = []
    for sid, num, identity, role, admin, version, last_id, last in rows:
        if type(sid) is not str or type(num) is not int:
            raise TypeError(f"session row {sid!r:.40}")
        out.append(Session(sid, num, identity, role, bool(admin), version, now, now, last_id, last))
    return out


def _shard_row(s: Shard) -> list:
    """A shard as a list; trailing defaults are left off (the layouts of older snapshots)."""
    row = [s.rank, s.incarnation, s.spec.to_wire(), s.available_kv_bytes, s.num_blocks, s.sid,
           s.serve, s.host_kv_bytes, s.host_kv_policy]
    for default in ("demote", 0, None):
        if row[-1] != default:
            break
        row.pop()
    return row


def _pool(row: list) -> PoolEntry:
    name, shard_count, epoch, shard_rows, dump = row
    shards = {}
    for rank, inc, spec, available, num_blocks, sid, *rest in shard_rows:
        serve = rest[0] if rest else None
        host_kv_bytes = rest[1] if len(rest) > 1 else 0  # absent in snapshots from before the host tier
        if type(host_kv_bytes) is not int or host_kv_bytes < 0 or len(rest) > 3:
            raise TypeError(f"shard row {rank!r:.10}: host_kv_bytes {host_kv_bytes!r:.40}")
        policy = rest[2] if len(rest) > 2 else "demote"  # absent in snapshots from before the choice
        if policy not in HOST_POLICIES:
            raise TypeError(f"shard row {rank!r:.10}: host_kv_policy {policy!r:.40}")
        try:
            kv_spec = KVSpec.from_wire(spec)
        except ManagerError as e:
            raise CorruptState(f"pool {name!r:.40}, shard {rank!r:.10}: {e}") from None
        shards[rank] = Shard(rank, inc, kv_spec, available, num_blocks, sid, serve, host_kv_bytes, policy)
    # verify=False: every caller checks the whole registry's invariants once it is complete
    # (journal.recover after the replay, kvpool snapshot/restore), instead of each pool twice
    pool = load_pool(dump, enable_events=True, verify=False) if dump is not None else None
    if type(name) is not str or type(epoch) is not int or type(shard_count) is not int:
        raise TypeError(f"pool row {name!r:.40}")
    return PoolEntry(name, shard_count, shards, epoch, pool)
