"""Request-level operations of one pool: which request holds which blocks.

Pure Python, no I/O: lookup, allocate, extend (decode / next prefill chunk), free, fork with
copy-on-write, reset_prefix_cache, evict, stats. "No space" is a return value (None) and leaves
every piece of state as it was; bad input raises ``PoolError``.

Caching happens when a request is given slots: the blocks that will be full once this step's
tokens are computed are entered into the prefix-cache map right away (as vLLM does). A later
request can only hit them in a later step of the same pool's scheduler, or in this step's forward
pass after the K/V of the layer were written, so it never reads unwritten K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.manager.core.block_pool import BlockPool, InvariantBroken
from kvpool.manager.core.host_tier import Copy, HostTier
from kvpool.manager.core.kv_events import AllBlocksCleared, BlockStored, KVEvent
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool_node import NodeLink


class PoolError(ValueError):
    """Bad input to a pool operation (unknown or duplicate request, impossible counts).

    A message about a request names it by ``{req}`` and passes its key: ``str(e)`` shows the
    whole key, ``public()`` only the client's request id (the key's last part; the owner is the
    caller's own), which is what the step answers (manager/core/step.py)."""

    def __init__(self, code: str, message: str, key: object = None) -> None:
        super().__init__(message.format(req=repr(key)) if key is not None else message)
        self.code = code
        self.template = message
        self.key = key

    def public(self) -> str:
        key = self.key
        if key is None:
            return self.template
        return self.template.format(req=repr(key[-1] if type(key) is tuple and key else key))


class RequestBlocks:
    """The one mutable record of a request in the pool: its blocks, token count and known block
    hashes (the worker's own record of a request is worker/request.py ``Request``)."""

    __slots__ = ("blocks", "num_tokens", "hashes", "num_cached", "priority")

    def __init__(self, blocks: list[int], num_tokens: int, hashes: list[bytes], num_cached: int, priority: int = 0):
        self.blocks = blocks  # block table, block i holds tokens [i*bs, (i+1)*bs)
        self.num_tokens = num_tokens  # tokens given slots (this step's included), lookahead not
        self.hashes = hashes  # hashes of the request's full blocks known so far
        self.num_cached = num_cached  # leading blocks already entered into the map
        self.priority = priority  # the request's (vLLM's meaning): the node tier keeps its blocks by it


@dataclass
class PoolStats:
    lookup_tokens: int = 0  # prompt tokens looked up by allocations
    hit_tokens: int = 0  # of which found in the prefix cache
    allocations: int = 0
    no_space: int = 0
    freed: int = 0
    forks: int = 0
    cow_copies: int = 0
    node_host_hit_tokens: int = 0  # prompt tokens taken from the node tier's host level
    node_disk_hit_tokens: int = 0  # and from its disk level


NODE_LEVELS = {"node_host": "host", "node_disk": "disk"}  # admin tier names -> the node tier's levels
PIN_OWNER = "\x00pin"  # the owner of a retention pin's holding (never a session's sid: those are hex)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Pool:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_events: bool = False,
        host_blocks: int = 0, host_policy: str = "demote",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks, enable_caching, enable_events)
        self.requests: dict[object, RequestBlocks] = {}
        self.stats = PoolStats()
        self.host: HostTier | None = None
        self.saves: list[Copy] = []  # this sub-op's save orders (device -> host), see take_copies
        self.loads: list[Copy] = []  # this sub-op's load orders (host -> device)
        self.writes: list[Copy] = []  # this sub-op's write-through orders (device -> host, after the forward)
        self.fresh: set[int] = set()  # device blocks hashed this step: not computed yet, never saved
        self.node: NodeLink | None = None  # the node tier behind the host tier (manager/core/pool_node.py)
        if host_blocks >= 2 and enable_caching:
            self.set_host(HostTier(host_blocks, block_size, enable_events, host_policy))

    @property
    def tiered(self) -> bool:
        """A tier behind the device blocks: reused ones may be saved, this step's are fresh."""
        return self.host is not None or self.node is not None

    def set_node(self, tier: NodeTier) -> None:
        """Puts the node tier of the pool's layout behind the device (and host) blocks."""
        if self.blocks.enable_caching:
            self.node = NodeLink(tier, self.block_size, self.stats)
            tier.links += 1
            self.blocks.on_reuse = self._demote
            if self.host is not None:
                self.host.blocks.on_reuse = self.node.demote_private

    def set_host(self, host: HostTier) -> None:
        """Puts ``host`` behind the device blocks: cached blocks reused from now on are demoted
        (under write-through too: a hash the host tier dropped since its write is saved again)."""
        self.host = host
        host.blocks.set_events(self.blocks.events_enabled)
        self.blocks.on_reuse = self._demote
        if self.node is not None:
            host.blocks.on_reuse = self.node.demote_private

    def _demote(self, block: int, h: bytes) -> None:
        host, node = self.host, self.node
        if block in self.fresh:  # its K/V is written by this very step's forward: nothing to save
            if host is not None and host.writing:
                host.withdraw(block)  # nor to write through
            if node is not None and node.posted:
                node.withdraw(block)
            return
        if host is not None:  # and what the host tier hands out moves on to the node tier
            copy = host.demote(block, h, None)
            if copy is not None:
                self.saves.append(copy)
        elif node is not None:
            node.demote(block, h)

    def take_copies(self) -> tuple[list[Copy], list[Copy], list[Copy]]:
        """The save, load and write orders of the sub-op just run (manager/core/step.py puts
        them in its result): the worker runs every save of a step, then every load, then the
        forward pass, then every write (write-through copies the K/V that forward computed)."""
        saves, loads, writes = self.saves, self.loads, self.writes
        if saves or loads or writes:
            self.saves, self.loads, self.writes = [], [], []
        return saves, loads, writes

    def end_step(self) -> None:
        """The step's orders are all out: the host tier's pins end."""
        if self.host is not None:
            self.host.end_step()
        if self.node is not None:
            self.node.end_step()
        self.fresh.clear()

    @classmethod
    def restore(cls, blocks: BlockPool, block_size: int, requests: dict[object, RequestBlocks], stats: PoolStats) -> Pool:
        """A pool from its parts (manager/core/snapshot.py decodes them)."""
        pool = cls(2, block_size)  # a placeholder block pool, replaced below
        pool.blocks, pool.requests, pool.stats = blocks, requests, stats
        return pool

    # -- lookups ---------------------------------------------------------------------------

    @property
    def events_enabled(self) -> bool:
        return self.blocks.events_enabled

    def set_events(self, enabled: bool) -> None:
        """KV events on or off for both tiers (``BlockPool.set_events``); a host tier added later
        follows (``set_host``). Set at construction, and by the daemon on a recovered pool."""
        self.blocks.set_events(enabled)
        if self.host is not None:
            self.host.blocks.set_events(enabled)

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last call (``BlockPool.take_events``), the host
        tier's after the device's (``medium: "CPU"``). vLLM's AllBlocksCleared names no medium,
        so a subscriber drops both tiers on it: after a device clear (a device reset leaves the
        host tier alone) the host tier is stated again whole instead of its own events."""
        if self.host is None:
            return self.blocks.take_events()
        device, host = self.blocks.take_events(), self.host.take_events()
        if any(type(ev) is AllBlocksCleared for ev in device):
            hashes = list(self.host.blocks.cached)
            host = [BlockStored(hashes, None, "CPU")] if hashes else []
        return [*device, *host]

    def restate_events(self) -> None:
        """Replaces the queued events with what a subscriber needs to match this pool whatever it
        saw before (a recovered state, a re-formed pool): a clear, every device hash, then every
        host hash with ``medium: "CPU"``."""
        self.blocks.restate_events()
        if self.host is not None:
            self.host.restate_events()

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of the chain that are cached (no side effects)."""
        return len(self.blocks.lookup(hashes))

    # -- allocation ------------------------------------------------------------------------

    def allocate(
        self,
        req_id: object,
        hashes: Sequence[bytes],
        num_prompt_tokens: int,
        max_new_tokens: int,
        lookahead: int = 0,
        priority: int = 0,
    ) -> tuple[int, list[int]] | None:
        """Admits a request: cached prefix + slots for up to ``max_new_tokens`` prompt tokens.

        ``hashes`` are the prompt's full-block hashes. The block holding the last prompt token
        is never taken from the cache (its logits must be computed). Returns
        ``(num_cached_tokens, block_table)``, or None when it does not fit (nothing changed).
        Tokens computed this step: ``min(max_new_tokens, num_prompt_tokens - num_cached_tokens)``.
        """
        if req_id in self.requests:
            raise PoolError("duplicate_request", "request {req} already holds blocks", req_id)
        if num_prompt_tokens < 1 or max_new_tokens < 1 or lookahead < 0:
            raise PoolError("bad_count", "need num_prompt_tokens >= 1, max_new_tokens >= 1, lookahead >= 0")
        if len(hashes) > num_prompt_tokens // self.block_size:
            raise PoolError("bad_hashes", f"{len(hashes)} hashes for {num_prompt_tokens} prompt tokens")
        bs, bp = self.block_size, self.blocks
        limit = (num_prompt_tokens - 1) // bs  # the block of the last prompt token is computed
        cached, hits = bp.cached, []  # BlockPool.lookup, inlined: the hot path of admission
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        nh = len(hits)
        if nh > limit:  # at most one over: len(hashes) <= num_prompt_tokens // bs was checked
            del hits[limit:]
            nh = limit
        host_hits = self.host.lookup(hashes[nh:limit]) if self.host is not None else []
        k = nh + len(host_hits)
        if self.node is not None:
            self.node.priority = priority
        node_hits = self.node.plan(hashes[k:limit]) if self.node is not None and k < limit else []
        stats = self.stats
        num_cached = (k + len(node_hits)) * bs
        num_tokens = num_cached + min(max_new_tokens, num_prompt_tokens - num_cached)
        num_new = -(-(num_tokens + lookahead) // bs) - nh  # _cdiv, inlined
        if num_new > len(bp.free_queue) - (bp.num_reclaimable(hits) if hits else 0):
            stats.no_space += 1
            return None
        # Counted at admission, as vLLM 0.33's scheduler records prefix-cache stats: a request
        # refused for space and asked again is looked up once, not once per refusal.
        stats.lookup_tokens += num_prompt_tokens
        stats.hit_tokens += num_cached
        stats.allocations += 1
        if hits:
            bp.touch(hits)
        if host_hits:
            self.host.pin(host_hits)  # type: ignore[union-attr]  # before any demotion below
        node = self.node
        if node_hits:
            node_hits = node.take(node_hits)  # type: ignore[union-attr]  # held before any demotion below
        # _cache_full, inlined: the blocks after the hits are fresh, the first of them full
        n_full = min(num_tokens // bs, len(hashes))
        new = bp.get_cached_blocks(num_new, hashes[nh:n_full], hashes[nh - 1] if nh else None)
        if host_hits:
            self.loads += self.host.load(host_hits, new[: len(host_hits)])  # type: ignore[union-attr]
        if node_hits:
            node.load(node_hits, new[k - nh: k - nh + len(node_hits)])  # type: ignore[union-attr]
        blocks = hits + new
        req = self.requests[req_id] = RequestBlocks(blocks, num_tokens, list(hashes), n_full, priority)
        if n_full > nh and (self.host is not None or node is not None):
            self.fresh.update(new[: n_full - nh])
            if self.host is not None and self.host.policy == "write_through":
                self._write_through(req, nh, n_full, hashes[nh - 1] if nh else None)
            loaded = k + len(node_hits)  # the blocks after the loaded ones are computed by this step
            if node is not None and n_full > loaded and node.tier.eager:
                node.write(new[loaded - nh: n_full - nh], hashes[loaded:n_full], hashes[loaded - 1] if loaded else None)
        return num_cached, blocks

    def extend(
        self, req_id: object, num_tokens: int, new_hashes: Sequence[bytes] = (), lookahead: int = 0
    ) -> tuple[list[int], list[tuple[int, int, int]]] | None:
        """Grows a request to ``num_tokens`` slots (next prefill chunk or decode tokens).

        ``new_hashes`` continue the request's chain (blocks that became full since the last
        call). Returns ``(new_block_ids, copies)`` where each copy ``(index, src, dst)`` says the
        shared partial block at ``index`` was replaced by ``dst`` and the worker must copy
        ``src -> dst`` before writing (copy-on-write after fork). None when it does not fit.
        """
        req = self._get(req_id)
        if lookahead < 0:
            raise PoolError("bad_count", f"lookahead must be >= 0, got {lookahead}")
        if num_tokens < req.num_tokens:
            raise PoolError("bad_count", f"num_tokens {num_tokens} < current {req.num_tokens}")
        if new_hashes and len(req.hashes) + len(new_hashes) > num_tokens // self.block_size:
            raise PoolError("bad_hashes", f"{len(req.hashes)} + {len(new_hashes)} hashes for {num_tokens} tokens: "
                            "more than their full blocks")
        bs, bp = self.block_size, self.blocks
        cow_index = req.num_tokens // bs if req.num_tokens % bs and num_tokens > req.num_tokens else -1
        cow = cow_index >= 0 and bp.ref_cnt[req.blocks[cow_index]] > 1
        num_new = max(0, _cdiv(num_tokens + lookahead, bs) - len(req.blocks)) + cow
        if num_new > bp.num_free:
            self.stats.no_space += 1
            return None
        new = bp.get_new_blocks(num_new)
        copies: list[tuple[int, int, int]] = []
        if cow:
            dst = new.pop()
            src = req.blocks[cow_index]
            bp.free_blocks((src,))  # ref > 1, so it stays in use by its other holders
            req.blocks[cow_index] = dst
            copies.append((cow_index, src, dst))
            self.stats.cow_copies += 1
        req.blocks.extend(new)
        req.num_tokens = num_tokens
        req.hashes.extend(new_hashes)
        self._cache_full(req)
        return new, copies

    def free(self, req_id: object, computed: int | None = None) -> None:
        """Releases the request's blocks. ``computed``: the tokens whose K/V the client wrote,
        when it says so; the request's hashed blocks past them lose their hashes first, since
        a step the client was answered for never ran (preempted or finished before it did),
        and no later hit may read K/V that was never written (vLLM caches computed blocks)."""
        req = self.requests.pop(req_id, None)
        if req is None:
            raise PoolError("unknown_request", "request {req} holds no blocks", req_id)
        if computed is not None and computed // self.block_size < req.num_cached:
            self._uncache_uncomputed(req, computed // self.block_size)
        self.blocks.free_blocks(reversed(req.blocks))
        self.stats.freed += 1

    def _uncache_uncomputed(self, req: RequestBlocks, first: int) -> None:
        """Drops the hashes of ``req``'s blocks from index ``first`` on (their K/V was never
        written); under write-through also the host copies ordered of them."""
        bp, host = self.blocks, self.host
        for b in req.blocks[first:req.num_cached]:
            h = bp.block_hash[b]
            if h is None:
                continue
            bp.uncache(b)
            if host is not None and host.policy == "write_through":
                host.forget(b, h)

    def fork(self, parent_id: object, child_id: object) -> list[int]:
        """The child shares the parent's written blocks (not its empty lookahead blocks).

        A shared partial last block is copied on the first write by either (see ``extend``).
        """
        parent = self._get(parent_id)
        if child_id in self.requests:
            raise PoolError("duplicate_request", "request {req} already holds blocks", child_id)
        n_full = parent.num_tokens // self.block_size
        blocks = parent.blocks[: _cdiv(parent.num_tokens, self.block_size)]
        self.blocks.touch(blocks)
        # the child knows only the hashes of blocks it holds written (not the parent's prompt tail)
        hashes = parent.hashes[:n_full]
        self.requests[child_id] = RequestBlocks(list(blocks), parent.num_tokens, hashes, min(parent.num_cached, n_full))
        self.stats.forks += 1
        return list(blocks)

    # -- admin -----------------------------------------------------------------------------

    def reset_prefix_cache(self, tier: str = "device") -> bool:
        """``tier``: "device", "host" (the pool's host tier), "node_host" or "node_disk" (a level
        of the node tier the pool shares with every pool of its layout)."""
        if tier == "host":
            return self._host_tier().reset()
        if tier in NODE_LEVELS:
            return self._node_tier().reset(NODE_LEVELS[tier])
        return self.blocks.reset_prefix_cache()

    def evict(self, n: int, tier: str = "device") -> int:
        if n < 0:
            raise PoolError("bad_count", f"cannot evict {n} blocks")
        if tier == "host":
            return self._host_tier().evict(n)
        if tier in NODE_LEVELS:
            return self._node_tier().evict(NODE_LEVELS[tier], n)
        return self.blocks.evict(n)

    def _node_tier(self) -> NodeTier:
        if self.node is None:
            raise PoolError("no_node_tier", "the pool has no node tier: the manager runs none, or its worker mapped none")
        return self.node.tier

    def _host_tier(self) -> HostTier:
        if self.host is None:
            raise PoolError("no_host_tier", "the pool has no host tier: its workers offered no --host-kv-memory")
        return self.host

    def pin(self, key: object, hashes: Sequence[bytes], share: float) -> int | None:
        """Holds the leading cached blocks of ``hashes`` under ``key`` (a retention pin: no
        eviction takes them until ``free(key)``); how many, or None when that would hold more than
        ``share`` of the pool's blocks in pins (nothing changed)."""
        if key in self.requests:
            raise PoolError("duplicate_request", "pin {req} exists", key)
        if not self.pin_fits(hashes, share):
            return None
        hits = self.blocks.lookup(hashes)
        self.blocks.touch(hits)
        self.requests[key] = RequestBlocks(hits, len(hits) * self.block_size, list(hashes[:len(hits)]), len(hits))
        return len(hits)

    def pin_fits(self, hashes: Sequence[bytes], share: float) -> bool:
        """Whether ``pin`` of ``hashes`` stays within ``share`` (no side effects)."""
        return self.pinned_blocks() + len(self.blocks.lookup(hashes)) <= int(share * (self.blocks.num_blocks - 1))

    def pinned_blocks(self) -> int:
        return sum(len(r.blocks) for k, r in self.requests.items() if type(k) is tuple and k[0] == PIN_OWNER)

    def free_all(self) -> int:
        """Frees every request (a dead session or a new epoch); returns how many."""
        ids = list(self.requests)
        for rid in ids:
            self.free(rid)
        return len(ids)

    def snapshot_stats(self) -> dict:
        bp, s = self.blocks, self.stats
        usable = bp.num_blocks - 1
        return {
            "num_blocks": bp.num_blocks,
            "block_size": self.block_size,
            "free_blocks": bp.num_free,
            "used_blocks": bp.num_used,
            "cached_blocks": len(bp.cached),
            "usage": bp.num_used / usable,
            "requests": len(self.requests),
            "lookup_tokens": s.lookup_tokens,
            "hit_tokens": s.hit_tokens,
            "prefix_hit_rate": s.hit_tokens / s.lookup_tokens if s.lookup_tokens else 0.0,
            "allocations": s.allocations,
            "no_space": s.no_space,
            "evictions": bp.num_evictions,
            "freed": s.freed,
            "forks": s.forks,
            "cow_copies": s.cow_copies,
            **(self.host.usage() if self.host is not None else {}),
            **({"node_hit_tokens": sum(self.node.hit_tokens.values()),
                "node_host_hit_tokens": self.node.hit_tokens["host"],
                "node_disk_hit_tokens": self.node.hit_tokens["disk"]} if self.node is not None else {}),
        }

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        holdings: dict[int, int] = {}
        for req in self.requests.values():
            if len(req.blocks) < _cdiv(req.num_tokens, self.block_size):
                raise InvariantBroken("request lacks slots")
            for b in req.blocks:
                holdings[b] = holdings.get(b, 0) + 1
        ref = self.blocks.ref_cnt
        for b in range(1, self.blocks.num_blocks):
            if ref[b] != holdings.get(b, 0):
                raise InvariantBroken(f"block {b}: ref_cnt {ref[b]} != holders {holdings.get(b, 0)}")

    # -- internals -------------------------------------------------------------------------

    def _get(self, req_id: object) -> RequestBlocks:
        req = self.requests.get(req_id)
        if req is None:
            raise PoolError("unknown_request", "request {req} holds no blocks", req_id)
        return req

    def _cache_full(self, req: RequestBlocks) -> None:
        n_full = min(req.num_tokens // self.block_size, len(req.hashes))
        start = req.num_cached
        if n_full > start:
            parent = req.hashes[start - 1] if start else None
            self.blocks.cache_blocks(req.blocks[start:n_full], req.hashes[start:n_full], parent)
            if self.host is not None or self.node is not None:
                self.fresh.update(req.blocks[start:n_full])
                if self.host is not None and self.host.policy == "write_through":
                    self._write_through(req, start, n_full, parent)
                if self.node is not None and self.node.tier.eager:
                    self.node.priority = req.priority
                    self.node.write(req.blocks[start:n_full], req.hashes[start:n_full], parent)
            req.num_cached = n_full

    def _write_through(self, req: RequestBlocks, start: int, end: int, parent: bytes | None) -> None:
        """Write orders for blocks ``[start, end)`` of ``req``, full as of this step."""
        host = self.host
        for b, h in zip(req.blocks[start:end], req.hashes[start:end]):
            copy = host.write(b, h, parent)  # type: ignore[union-attr]
            if copy is not None:
                self.writes.append(copy)
            parent = h
