"""The index of one external server's KV cache (a vLLM server), rebuilt from its KV events.

Pure: no sockets, no clock. manager/external/feed.py hands it every batch the server publishes
(live, or answered by its replay socket) and does what it asks (a replay from a sequence
number); ``lookup`` answers how many leading blocks of a prompt the server holds.

Keys. vLLM's ``BlockStored`` carries each block's token ids, its parent's vLLM hash and the
extra keys (LoRA name, cache salt, multimodal items). The mirror computes kvpool's own chained
hash of each block (shared/hashing.py: the hash the front door computes from a prompt) and keeps
vLLM's hash -> kvpool's, per medium, so a ``BlockRemoved`` naming vLLM's hash finds it. The
index thus never depends on vLLM's hash function, its seed or its hash width.

Sequencing. Batches carry a sequence number that starts at 0 when the publisher starts:
- the expected one is applied;
- a later one means batches were lost: they are asked for again (``replay_from``) and live
  batches are held until the replay ends, then applied in order;
- an earlier one means the publisher restarted (a new server holds nothing): the index is
  cleared, and filled again from its sequence 0 (replayed when it is not the one received);
- a replay that cannot give the missing batches (its buffer no longer has them) leaves the
  index **stale**: the blocks it holds may be wrong, so ``lookup`` claims nothing until the
  index is clean again, which ``AllBlocksCleared`` (vLLM's `/reset_prefix_cache`) or a restart
  from sequence 0 makes it. A mirror that never saw sequence 0 is stale too;
- a server whose events stopped while it computes (``silenced``: manager/external/silence.py)
  is stale, and its next batch starts a rebuild from a clean state: the index is emptied and
  filled again from the server's sequence 0 through its replay socket (stale for good, until a
  clear or a restart, when its buffer no longer has batch 0).

Tiers. Blocks are kept per ``medium``: vLLM's device tier is "GPU" (the CPU build says so too),
its CPU offloading tier "CPU". ``lookup_tiers`` gives the leading blocks in the device tier and
those that continue the prefix in the CPU tier (vLLM loads them instead of computing them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvpool.shared.hashing import SEED, block_extra, hash_block, tokens_to_bytes

DEVICE = "GPU"  # vLLM's medium of its device tier (an event without a medium means it)
HOST = "CPU"  # vLLM's medium of its CPU offloading tier
REBUILDING = "rebuilding from its replay buffer after its events stopped"
MAX_HELD = 100_000  # live batches held during one replay; more make the mirror stale


@dataclass
class MirrorStats:
    applied: int = 0  # batches applied
    stored: int = 0  # blocks indexed
    removed: int = 0
    cleared: int = 0  # AllBlocksCleared events
    gaps: int = 0  # sequence gaps seen
    replays: int = 0  # replays asked for
    lost: int = 0  # batches no replay could give
    restarts: int = 0  # publisher restarts seen (its sequence went back)
    orphans: int = 0  # stored blocks whose parent is not indexed (not indexable)
    unknown_removed: int = 0  # removals of blocks not indexed
    undecodable: int = 0  # payloads that were not KV-event batches
    silenced: int = 0  # times its events stopped while it computed (manager/external/silence.py)
    rebuilds: int = 0  # rebuilds from a clean state begun (after a silence)

    def to_wire(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Mirror:
    name: str
    block_size: int
    # medium -> vLLM's hash -> kvpool's hash, and kvpool's hash -> how many vLLM blocks have it
    blocks: dict[str, dict[object, bytes]] = field(default_factory=dict)
    counts: dict[str, Counter] = field(default_factory=dict)
    next_seq: int | None = None  # the sequence number expected next (None: nothing seen yet)
    stale: str | None = "no events received yet"  # why lookups claim nothing (None: the index is exact)
    replaying: int | None = None  # the replay asked for, from this sequence number
    held: list[tuple[int, list[dict]]] = field(default_factory=list)
    stats: MirrorStats = field(default_factory=MirrorStats)
    rebuild: bool = False  # the next live batch starts a rebuild from sequence 0 (after a silence)

    # -- what the feed hands in ------------------------------------------------------------

    def live(self, seq: int, events: list[dict]) -> int | None:
        """A batch from the subscription; returns the sequence number to replay from, if any."""
        if self.rebuild and self.replaying is None:  # events again after a silence: from a clean state
            self.rebuild = False
            self.stats.rebuilds += 1
            self._clear()
            self.next_seq, self.stale = None, REBUILDING
            return self._take(seq, events)
        if self.replaying is not None:
            if len(self.held) >= MAX_HELD:
                self._make_stale(f"more than {MAX_HELD} batches arrived during a replay")
                self.replaying, self.held = None, []
            else:
                self.held.append((seq, events))
                return None
        return self._take(seq, events)

    def replayed(self, seq: int, events: list[dict]) -> None:
        """A batch answered by the replay socket (in order)."""
        if self.next_seq is None:  # replaying from the publisher's start
            if seq == 0:
                self.stale = None
            else:
                self.stats.lost += seq
                self._make_stale(f"batches 0..{seq - 1} were lost (the server's replay buffer no longer has them)")
            self._apply(seq, events)
        elif seq == self.next_seq:
            self._apply(seq, events)
        elif seq > self.next_seq:  # the buffer starts after what we miss
            self.stats.lost += seq - self.next_seq
            self._make_stale(f"batches {self.next_seq}..{seq - 1} were lost (the server's replay buffer no longer "
                             "has them)")
            self._apply(seq, events)
        # seq < next_seq: a batch already applied

    def replay_done(self) -> None:
        """The replay ended (its end marker, or the feed gave up on it): the held live batches
        follow, in order; a gap among them was neither published to us nor replayed: stale."""
        held, self.held, self.replaying = self.held, [], None
        if self.next_seq is None and held:  # nothing replayed, not even sequence 0
            first = held[0][0]
            self.stats.lost += first
            self._make_stale(f"batches 0..{first - 1} were lost (the server's replay buffer no longer has them)")
            self.next_seq = first
        for seq, events in held:
            if self.next_seq is not None and seq < self.next_seq:
                continue  # replayed already
            if self.next_seq is not None and seq > self.next_seq:
                self.stats.lost += seq - self.next_seq
                self._make_stale(f"batches {self.next_seq}..{seq - 1} were lost (neither published nor replayed)")
            self._apply(seq, events)

    def fail(self, why: str) -> None:
        """The feed cannot follow the server any more (its thread stopped): claim nothing."""
        self.stale = why

    def silenced(self, why: str) -> None:
        """Its events stopped while it computed blocks: claim nothing, and rebuild from a clean
        state once batches come again."""
        self.stats.silenced += 1
        self._make_stale(why)
        self.rebuild = True

    def undecodable(self) -> None:
        self.stats.undecodable += 1
        self._make_stale("a batch did not decode")

    # -- what the router asks --------------------------------------------------------------

    def lookup(self, hashes: list[bytes], medium: str = DEVICE) -> int:
        """Leading blocks of ``hashes`` (kvpool's chain) the server holds in ``medium``; 0 while stale."""
        if self.stale is not None:
            return 0
        counts = self.counts.get(medium)
        if not counts:
            return 0
        n = 0
        for h in hashes:
            if not counts.get(h):
                break
            n += 1
        return n

    def lookup_tiers(self, hashes: list[bytes]) -> tuple[int, int]:
        """(leading blocks of ``hashes`` in the device tier, the blocks after those that the CPU
        tier holds, in a row); (0, 0) while stale."""
        device = self.lookup(hashes)
        if self.stale is not None or not self.counts.get(HOST):
            return device, 0
        return device, self.lookup(hashes[device:], HOST)

    def num_blocks(self, medium: str = DEVICE) -> int:
        return len(self.blocks.get(medium, ()))

    def summary(self) -> dict:
        return {"stale": self.stale, "next_seq": self.next_seq, "replaying": self.replaying is not None,
                "rebuilding": self.rebuild,
                "blocks": {m: len(b) for m, b in self.blocks.items()}, **self.stats.to_wire()}

    # -- inside ----------------------------------------------------------------------------

    def _take(self, seq: int, events: list[dict]) -> int | None:
        expected = self.next_seq
        if expected is None:  # the first batch this mirror sees
            if seq == 0:
                self.stale = None  # the publisher's start: an empty cache, then every change
                self._apply(seq, events)
                return None
            return self._ask(0, seq, events)
        if seq == expected:
            self._apply(seq, events)
            return None
        if seq > expected:
            self.stats.gaps += 1
            return self._ask(expected, seq, events)
        # the sequence went back: the publisher restarted, with an empty cache
        self.stats.restarts += 1
        self._clear()
        self.next_seq = None
        if seq == 0:
            self.stale = None
            self._apply(seq, events)
            return None
        self._make_stale("the server restarted and its first batches were missed")
        return self._ask(0, seq, events)

    def _ask(self, start: int, seq: int, events: list[dict]) -> int:
        self.stats.replays += 1
        self.replaying = start
        self.held = [(seq, events)]
        return start

    def _make_stale(self, why: str) -> None:
        if self.stale is None or self.stale == REBUILDING:
            self.stale = why

    def _clear(self) -> None:
        self.blocks.clear()
        self.counts.clear()

    def _apply(self, seq: int, events: list[dict]) -> None:
        self.next_seq = seq + 1
        self.stats.applied += 1
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                self._removed(ev)
            elif kind == "AllBlocksCleared":
                self.stats.cleared += 1
                self._clear()
                self.stale = None  # a known state again: empty

    def _stored(self, ev: dict) -> None:
        medium = ev.get("medium") or DEVICE
        hashes, tokens = ev.get("block_hashes") or [], ev.get("token_ids") or []
        bs = ev.get("block_size") or self.block_size
        lora = ev.get("lora_name")
        extras = ev.get("extra_keys") or [None] * len(hashes)
        table = self.blocks.setdefault(medium, {})
        counts = self.counts.setdefault(medium, Counter())
        parent_v = ev.get("parent_block_hash")
        if parent_v is None:
            parent = SEED
        else:
            parent = table.get(parent_v) or self._anywhere(parent_v)
            if parent is None:  # its parent is not indexed: this chain cannot be keyed
                self.stats.orphans += len(hashes)
                return
        for i, vh in enumerate(hashes):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            extra = _extra(extras[i] if i < len(extras) else None, lora, first=parent_v is None and i == 0)
            if len(block_tokens) != bs or extra is None:  # a partial block, or keys kvpool does not hash
                self.stats.orphans += len(hashes) - i
                return
            parent = hash_block(parent, tokens_to_bytes(block_tokens), extra)
            if table.get(vh) != parent:
                if vh in table:
                    counts[table[vh]] -= 1
                table[vh] = parent
                counts[parent] += 1
                self.stats.stored += 1

    def _anywhere(self, vh: object) -> bytes | None:
        for table in self.blocks.values():
            if vh in table:
                return table[vh]
        return None

    def _removed(self, ev: dict) -> None:
        medium = ev.get("medium") or DEVICE
        table, counts = self.blocks.get(medium, {}), self.counts.get(medium)
        for vh in ev.get("block_hashes") or []:
            h = table.pop(vh, None)
            if h is None:
                self.stats.unknown_removed += 1
                continue
            self.stats.removed += 1
            if counts is not None:
                counts[h] -= 1
                if counts[h] <= 0:
                    del counts[h]


def _extra(keys: object, lora: str | None, first: bool) -> bytes | None:
    """kvpool's extra-key bytes of a block from vLLM's untagged ``extra_keys`` entry (in order:
    the LoRA name when ``lora_name`` is set, ``(identifier, offset)`` pairs of multimodal items,
    the cache salt, prompt-embedding digests). None: a key kvpool does not hash (embeddings)."""
    items = list(keys) if isinstance(keys, (list, tuple)) else []
    if lora is not None and items and items[0] == lora:
        items = items[1:]
    salt, mm = None, []
    for item in items:
        if isinstance(item, str):
            salt = item
        elif isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) \
                and isinstance(item[1], int):
            mm.append((item[1], item[0]))
        else:
            return None
    return block_extra(salt if first else None, lora, mm)
