"""The paged strategies on the real block-pool core: with or without prefix caching and forks, and
with a host tier behind the device blocks (``cfg.host_policy``, demote by default)."""

from __future__ import annotations

import math

from kvpool.manager.core.pool import Pool
from kvpool.shared.hashing import SEED, hash_block, hash_blocks, tokens_to_bytes

from .trace import Seq, SimConfig, TraceRequest


class Paged:
    """The real block-pool core. ``sharing``: prefix caching on and n samples forked (CoW).
    ``host``: a host tier of ``cfg.host_budget_x`` times the device blocks behind them (its
    copies are counted, not made: the simulator holds no KV; each operation is its own step)."""

    def __init__(self, cfg: SimConfig, sharing: bool, host: bool = False) -> None:
        self.cfg, self.sharing, self.bs = cfg, sharing, cfg.block_size
        num_blocks = cfg.budget_tokens // cfg.block_size + 1  # + the null block
        host_blocks = int(cfg.host_budget_x * (num_blocks - 1)) + 1 if host else 0
        self.pool = Pool(num_blocks, cfg.block_size, enable_caching=sharing, host_blocks=host_blocks,
                         host_policy=cfg.host_policy)
        self.watermark = math.ceil(cfg.watermark * (num_blocks - 1))
        self.frag_refusals = 0
        self._hashes: dict[int, list[bytes]] = {}  # prompt hashes of the queue head, kept across steps

    @property
    def bytes_copied(self) -> int:
        return self.copies * self.bs * self.cfg.kv_bytes_per_token

    @property
    def copies(self) -> int:
        return self.pool.stats.cow_copies

    @property
    def host_bytes_copied(self) -> int:
        """Device <-> host tier traffic (saves, writes and loads), whole blocks."""
        s = self.pool.host.stats if self.pool.host else None
        return (s.saves + s.writes + s.loads) * self.bs * self.cfg.kv_bytes_per_token if s else 0

    @property
    def host_hit_tokens(self) -> int:
        return self.pool.host.stats.hit_tokens if self.pool.host else 0

    @property
    def lookup_tokens(self) -> int:
        return self.pool.stats.lookup_tokens

    @property
    def hit_tokens(self) -> int:
        return self.pool.stats.hit_tokens

    def admit(self, req: TraceRequest, seqs: list[Seq]) -> bool:
        p, bs, bp = len(req.prompt), self.bs, self.pool.blocks
        if self.sharing:
            hashes = self._hashes.get(req.rid) or self._hashes.setdefault(req.rid, hash_blocks(req.prompt, bs))
            hits = bp.lookup(hashes[: (p - 1) // bs])
            need = -(-p // bs) - len(hits) + bp.num_reclaimable(hits)
        else:
            hashes, need = [], -(-p // bs) * len(seqs)
        if need > bp.num_free - self.watermark:
            return False
        self._hashes.pop(req.rid, None)
        if self.sharing:
            assert self.pool.allocate(seqs[0].uid, hashes, p, p) is not None
            for s in seqs[1:]:
                self.pool.fork(seqs[0].uid, s.uid)
        else:
            for s in seqs:
                assert self.pool.allocate(s.uid, hashes, p, p) is not None
        self.pool.end_step()  # a host tier's pins: the step's copies are ordered
        last = hashes[-1] if hashes else SEED
        for s in seqs:
            s.num_tokens, s.last_hash = p, last
        return True

    def grow(self, s: Seq) -> bool:
        n, bs = s.num_tokens + 1, self.bs
        new_hashes: tuple[bytes, ...] = ()
        if self.sharing and n % bs == 0:  # the decode token fills a block: continue the chain
            data = tokens_to_bytes([s.token(i) for i in range(n - bs, n)])
            new_hashes = (hash_block(s.last_hash, data),)
        if self.pool.extend(s.uid, n, new_hashes) is None:
            return False
        self.pool.end_step()
        if new_hashes:
            s.last_hash = new_hashes[0]
        s.num_tokens = n
        return True

    def release(self, s: Seq) -> None:
        self.pool.free(s.uid)

    def usage(self, seqs: list[Seq], head: TraceRequest | None) -> tuple[int, int, int, int, int]:
        bs, reqs = self.bs, self.pool.requests
        tails: dict[int, int] = {}  # partly written or empty blocks -> slots written (once if shared)
        entries = 0
        for s in seqs:
            r = reqs[s.uid]
            entries += len(r.blocks)
            for i in range(r.num_tokens // bs, len(r.blocks)):
                b = r.blocks[i]
                tails[b] = max(tails.get(b, 0), r.num_tokens - i * bs)
        unwritten = sum(bs - max(0, f) for f in tails.values())
        bp = self.pool.blocks
        return bp.num_used * bs - unwritten, unwritten, bp.num_free * bs, 0, entries

    def recount_written(self, seqs: list[Seq]) -> int:
        """Physical slots written, counted block by block (for --check)."""
        bs, fill = self.bs, {}
        for s in seqs:
            r = self.pool.requests[s.uid]
            assert r.num_tokens == s.num_tokens, f"seq {s.uid}: pool has {r.num_tokens}, sim {s.num_tokens}"
            for i, b in enumerate(r.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, r.num_tokens - i * bs)))
        self.pool.check_invariants()
        return sum(fill.values())
