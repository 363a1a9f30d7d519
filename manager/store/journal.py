"""The write-ahead command journal: the registry's mutations as records, and their replay.

The pool core is deterministic, so the registry's state is a pure function of the sequence of
mutating commands applied to it. Instead of diffing state, the registry journals each mutation
as a record with every nondeterministic value already resolved (the new session's sid, the
limits a registration was checked against); replaying the records in order through the same
registry methods rebuilds the exact state, free-queue order, hash map and step replies included.

Records (msgpack lists; ``Registry.record`` writes them)::

    ["open", sid, identity, role, admin, version]           a session opened (hello)
    ["end", sid]                                            deregister or expiry
    ["register", sid, pool, rank, count, incarnation, spec, available_kv_bytes, max_blocks, max_pools]
                                                            (+ serve, when the worker announced one)
    ["step", sid, msg_id, pool, ops]                        run_step again: the same results
    ["reset", pool]   ["evict", pool, n]   ["drain", enable]

The loop hands one iteration's records to the store as one *batch*:
``b"J" || crc32(payload) as u32le || payload``, payload ``msgpack([seq, [record...]])``, ``seq``
numbering the batches 1, 2, ... with no gap. A snapshot (manager/store/state_file.py) says which
``seq`` it includes; loading checks that the journal continues it exactly.
"""

from __future__ import annotations

import struct
import zlib

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.registry import Registry
from kvpool.shared.protocol import ManagerError, pack, unpack

_CRC = struct.Struct("<I")
UNLIMITED = 1 << 62


def encode_batch(seq: int, records: list[list]) -> bytes:
    payload = pack([seq, records])
    return b"J" + _CRC.pack(zlib.crc32(payload)) + payload


def decode_batch(blob: bytes) -> tuple[int, list[list]]:
    if type(blob) is not bytes or len(blob) < 5 or blob[:1] != b"J":
        raise CorruptState("journal batch: bad header")
    payload = blob[5:]
    if _CRC.unpack(blob[1:5])[0] != zlib.crc32(payload):
        raise CorruptState(f"journal batch: checksum mismatch ({len(blob)} bytes)")
    try:
        seq, records = unpack(payload)
    except Exception as e:
        raise CorruptState(f"journal batch: not a [seq, records] pair: {e}") from None
    if type(seq) is not int or type(records) is not list:
        raise CorruptState("journal batch: not a [seq, records] pair")
    return seq, records


def replay(reg: Registry, blobs: list[bytes], after_seq: int, now: float) -> int:
    """Applies the journal batches following the snapshot at ``after_seq``; returns the last seq.

    Raises CorruptState on a gap, a bad batch or a record that cannot apply: the caller then
    drops ``reg`` (nothing is half-loaded into a serving manager).
    """
    seq = after_seq
    limits = reg.max_sessions, reg.max_pools, reg.max_blocks
    reg.max_sessions = UNLIMITED  # opens were checked against the limit when they happened
    try:
        for i, blob in enumerate(blobs):
            bseq, records = decode_batch(blob)
            if bseq != seq + 1:
                raise CorruptState(f"journal batch {i}: seq {bseq} does not follow {seq} (a gap or a "
                                   "half-compacted journal)")
            for rec in records:
                apply(reg, rec, now)
            seq = bseq
    finally:
        reg.max_sessions, reg.max_pools, reg.max_blocks = limits
    return seq


def apply(reg: Registry, rec: list, now: float) -> None:
    """One record through the registry method that journaled it."""
    try:
        kind = rec[0]
        if kind == "step":
            _, sid, msg_id, name, ops = rec
            reg.step(reg.sessions[sid], reg.pools[name], ops, msg_id)
        elif kind == "open":
            _, sid, identity, role, admin, version = rec
            reg.open_session(identity, role, admin, version, now, sid=sid)
        elif kind == "end":
            reg.end_session(rec[1])
        elif kind == "register":
            _replay_register(reg, rec)
        elif kind == "reset":
            reg.reset_cache(reg.pools[rec[1]])
        elif kind == "evict":
            reg.evict(reg.pools[rec[1]], rec[2])
        elif kind == "drain":
            reg.set_draining(bool(rec[1]))
        else:
            raise CorruptState(f"journal record of unknown kind {kind!r:.40}")
    except CorruptState:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptState(f"journal record {str(rec)[:120]} does not apply: {type(e).__name__}: {e}") from None


def _replay_register(reg: Registry, rec: list) -> None:
    _, sid, name, rank, count, incarnation, spec, available, max_blocks, max_pools, *serve = rec
    reg.max_blocks, reg.max_pools = max_blocks, max_pools
    try:
        reg.register(reg.sessions[sid], name, rank, count, incarnation, spec, available, *serve[:1])
    except ManagerError:
        pass  # it failed the same way when it happened


def recover(reg: Registry, snap: bytes, blobs: list[bytes], committed: int, what: str, now: float) -> tuple[int, int]:
    """Snapshot + journal -> the empty ``reg``, verified; returns (snapshot seq, last seq).

    ``committed`` is the store's record of the last committed batch: the journal must end there.
    """
    from kvpool.manager.store.state_file import decode_state, load_registry

    snap_seq = load_registry(decode_state(snap, f"snapshot of {what}"), reg, now)
    seq = replay(reg, blobs, snap_seq, now)
    if seq != committed:
        raise CorruptState(f"{what}: the journal ends at batch {seq}, but {committed} were committed "
                           "(batches are missing)")
    try:
        reg.check_invariants()
    except AssertionError as e:
        raise CorruptState(f"{what}: the recovered state breaks an invariant: {e}") from None
    for entry in reg.pools.values():  # replayed events were published when they happened
        if entry.pool is not None and entry.pool.blocks.events:
            entry.pool.blocks.events = []
    return snap_seq, seq
