"""The write-ahead command journal: batches of the registry's mutation records, and their replay.

The pool core is deterministic, so the registry's state is a pure function of the sequence of
mutating commands applied to it. Instead of diffing state, the registry journals each mutation
as a typed record (manager/state/mutations.py) with every nondeterministic value already resolved
(the new session's sid, the limits a registration was checked against); replaying the records
in order through ``Registry.apply`` (the store's ``StateView``), the code the live path runs, rebuilds the exact state,
free-queue order, hash map and step replies included. Records travel as msgpack lists (their
layout: manager/state/mutations.py).

The loop hands one iteration's records to the store as one *batch*:
``b"J" || crc32(payload) as u32le || payload``, payload ``msgpack([seq, [record...]])``, ``seq``
numbering the batches 1, 2, ... with no gap. A snapshot (manager/store/state_file.py) says which
``seq`` it includes; loading checks that the journal continues it exactly.
"""

from __future__ import annotations

import struct
import zlib

from kvpool.manager.core.snapshot import CorruptState
from kvpool.manager.state.mutations import Mutation, ShardRegistered, from_wire, to_wire
from kvpool.manager.store.view import StateView
from kvpool.shared.protocol import ManagerError, pack, unpack

_CRC = struct.Struct("<I")


def encode_batch(seq: int, records: list[Mutation]) -> bytes:
    return encode_lists(seq, [to_wire(rec) for rec in records])


def encode_lists(seq: int, lists: list[list]) -> bytes:
    """A batch of records already in their wire form (``decode_batch`` gives them back)."""
    payload = pack([seq, lists])
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


def replay(reg: StateView, blobs: list[bytes], after_seq: int, now: float) -> int:
    """Applies the journal batches following the snapshot at ``after_seq``; returns the last seq.

    Raises CorruptState on a gap, a bad batch or a record that cannot apply: the caller then
    drops ``reg`` (nothing is half-loaded into a serving manager).
    """
    seq = after_seq
    with reg.replaying():  # opens were checked against the session limit when they happened
        for i, blob in enumerate(blobs):
            bseq, records = decode_batch(blob)
            if bseq != seq + 1:
                raise CorruptState(f"journal batch {i}: seq {bseq} does not follow {seq} (a gap or a "
                                   "half-compacted journal)")
            for rec in records:
                apply(reg, rec, now)
            seq = bseq
    return seq


def apply(reg: StateView, raw: list, now: float) -> None:
    """One journal list through ``Registry.apply``, as the live call ran it."""
    try:
        rec = from_wire(raw)
    except (TypeError, ValueError) as e:
        raise CorruptState(f"journal record {str(raw)[:120]} is not a record: {e}") from None
    try:
        reg.apply(rec, now)
    except ManagerError:
        if type(rec) is not ShardRegistered:
            raise
        # a registration is journaled before its checks: it failed the same way when it happened
    except CorruptState:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptState(f"journal record {str(raw)[:120]} does not apply: {type(e).__name__}: {e}") from None


def recover(reg: StateView, snap: bytes, blobs: list[bytes], committed: int, what: str, now: float) -> tuple[int, int]:
    """Snapshot + journal -> the empty ``reg``, verified; returns (snapshot seq, last seq).

    ``committed`` is the store's record of the last committed batch: the journal must end there.
    """
    from kvpool.manager.store.checks import gc_paused, verify_registry
    from kvpool.manager.store.state_file import decode_state, load_registry

    with gc_paused():
        snap_seq = load_registry(decode_state(snap, f"snapshot of {what}"), reg, now)
        seq = replay(reg, blobs, snap_seq, now)
        if seq != committed:
            raise CorruptState(f"{what}: the journal ends at batch {seq}, but {committed} were committed "
                               "(batches are missing)")
        verify_registry(reg, what)
    for entry in reg.pools.values():  # replayed events were published when they happened
        if entry.pool is not None:
            entry.pool.take_events()
    return snap_seq, seq
