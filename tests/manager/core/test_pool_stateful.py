"""Random operation sequences against the pool, with a simulated KV cache as the model.

The machine plays the worker: it "writes" each request's token ids into the slots of its block
table, performs copy-on-write copies, and after every step checks that
- every DESIGN.md invariant holds (``check_invariants``);
- every request reads back exactly its own tokens through its block table (so prefix hits,
  forks and copies never serve another request's data);
- no slot is written while its block is shared.

``HostPoolMachine`` runs the same rules on a pool with a host tier and a simulated host memory:
each rule is one step whose saves run, then its loads, before any write, and its write-through
copies after them; every load must read back exactly the tokens its hash stands for, and every
host-cached hash must hold them. ``WriteThroughPoolMachine`` does so under the write-through policy.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.manager.core.pool import Pool
from kvpool.manager.core.verify import verify_pool
from kvpool.shared.hashing import hash_blocks

BS = 4
NUM_BLOCKS = 12

prompt_st = st.lists(st.integers(0, 2), min_size=1, max_size=18)
prefix_st = st.sampled_from([[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 2, 2]])


class PoolMachine(RuleBasedStateMachine):
    HOST_BLOCKS = 0
    HOST_POLICY = "demote"

    def __init__(self):
        super().__init__()
        self.pool = Pool(NUM_BLOCKS, BS, enable_events=True, host_blocks=self.HOST_BLOCKS, host_policy=self.HOST_POLICY)
        self.host_kv: dict[int, list] = {}
        self.kv: dict[int, list] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.tokens: dict[int, list[int]] = {}  # the model: every live request's token ids
        self.next_id = 0
        self.content: dict[bytes, list[int]] = {}  # block hash -> the tokens it stands for
        self.host_reset = False  # the host tier's hashes were dropped by an admin reset

    def _write(self, rid, start, end):
        req = self.pool.requests[rid]
        for pos in range(start, end):
            b = req.blocks[pos // BS]
            assert self.pool.blocks.ref_cnt[b] == 1, f"write into shared block {b}"
            self.kv[b][pos % BS] = self.tokens[rid][pos]

    def _copy_tiers(self):
        """The step's host-tier orders as the worker runs them before the forward: every save,
        then every load; returns the writes, which run after it (``_write_through``)."""
        saves, loads, writes = self.pool.take_copies()
        for c in saves:
            self.host_kv[c.dst] = list(self.kv[c.src])
        for c in loads:
            h = self.pool.host.blocks.block_hash[c.src]
            assert self.host_kv.get(c.src) == self.content[h], f"load of host block {c.src} reads other tokens"
            self.kv[c.dst] = list(self.host_kv[c.src])
        return writes

    def _write_through(self, writes):
        for c in writes:
            self.host_kv[c.dst] = list(self.kv[c.src])

    def _hashes(self, rid, upto):
        tokens = self.tokens[rid][:upto]
        hashes = hash_blocks(tokens, BS)
        for i, h in enumerate(hashes):
            self.content[h] = tokens[i * BS : (i + 1) * BS]
        return hashes

    @rule(prefix=prefix_st, prompt=prompt_st, chunk=st.integers(1, 20), lookahead=st.integers(0, 5))
    def allocate(self, prefix, prompt, chunk, lookahead):
        rid, self.next_id = self.next_id, self.next_id + 1
        tokens = prefix + prompt
        self.tokens[rid] = tokens
        res = self.pool.allocate(rid, self._hashes(rid, len(tokens)), len(tokens), chunk, lookahead)
        if res is None:
            del self.tokens[rid]
            return
        writes = self._copy_tiers()
        cached, blocks = res
        assert cached % BS == 0 and cached < len(tokens)
        assert len(blocks) * BS >= min(len(tokens), cached + chunk) + lookahead
        self._write(rid, cached, self.pool.requests[rid].num_tokens)
        self._write_through(writes)
        self.pool.end_step()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), grow=st.integers(1, 9), lookahead=st.integers(0, 3))
    def extend(self, data, grow, lookahead):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        req = self.pool.requests[rid]
        old = req.num_tokens
        toks = self.tokens[rid]
        new_len = old + grow
        if new_len > len(toks):  # decode: generate tokens
            toks.extend(data.draw(st.lists(st.integers(0, 2), min_size=new_len - len(toks), max_size=new_len - len(toks))))
        known = len(req.hashes)
        new_hashes = self._hashes(rid, new_len)[known:] if new_len // BS > known else []
        res = self.pool.extend(rid, new_len, new_hashes, lookahead)
        if res is None:
            return
        writes = self._copy_tiers()
        _, copies = res
        for index, src, dst in copies:
            assert self.pool.requests[rid].blocks[index] == dst
            self.kv[dst] = list(self.kv[src])
        self._write(rid, old, new_len)
        self._write_through(writes)
        self.pool.end_step()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        n = self.pool.requests[parent].num_tokens
        self.pool.fork(parent, child)
        self.tokens[child] = self.tokens[parent][:n]

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        free_hashed = self.pool.blocks.free_queue.num_hashed()
        assert self.pool.evict(n) == min(n, free_hashed)

    @rule()
    def reset(self):
        in_use = self.pool.blocks.num_used > 0
        assert self.pool.reset_prefix_cache() is (not in_use)

    @invariant()
    def invariants_hold(self):
        self.pool.check_invariants()
        verify_pool(self.pool)  # the bulk check recovery runs agrees on every reachable state

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for rid, req in self.pool.requests.items():
            for pos in range(req.num_tokens):
                b = req.blocks[pos // BS]
                assert self.kv[b][pos % BS] == self.tokens[rid][pos], f"request {rid} pos {pos}"

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        # a later hit on any cached block (map entry or duplicate) must find the right K/V
        bp = self.pool.blocks
        for b in range(1, NUM_BLOCKS):
            h = bp.block_hash[b]
            if h is not None:
                assert self.kv[b] == self.content[h], f"block {b} holds other tokens than its hash"


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


class HostPoolMachine(PoolMachine):
    HOST_BLOCKS = 12

    @rule(k=st.integers(0, 7), prompt=st.lists(st.integers(0, 2), min_size=1, max_size=3), chunk=st.integers(1, 20))
    def allocate_with_a_long_prefix(self, k, prompt, chunk):
        # eight 2-block prefixes, each request done within its step (then freed): more than the
        # device keeps around, so they are saved and come back by load
        rid = self.next_id
        self.allocate([10 + k] * 8, prompt, chunk, 0)
        if rid in self.tokens:
            self.pool.free(rid)
            del self.tokens[rid]

    @rule(k=st.integers(0, 7), j=st.integers(0, 7))
    def free_and_reuse_in_one_step(self, k, j):
        # one step: A admitted (its blocks full, hashed, written through after the forward), A
        # freed, B admitted into A's blocks if it must; the forward writes A's tokens where B did
        # not take the block over (a worker would not compute A at all), then B's
        orders, ran, first = [], [], self.next_id
        for rid, tokens in ((self.next_id, [10 + k] * 8 + [1]), (self.next_id + 1, [20 + j] * 8 + [2])):
            self.tokens[rid] = tokens
            res = self.pool.allocate(rid, self._hashes(rid, len(tokens)), len(tokens), len(tokens), 0)
            if res is None:
                del self.tokens[rid]
                continue
            orders.append(self.pool.take_copies())
            req = self.pool.requests[rid]
            ran.append((rid, list(req.blocks), res[0], req.num_tokens))
            if rid == first:
                self.pool.free(rid)
        self.next_id += 2
        for saves, _, _ in orders:
            for c in saves:
                self.host_kv[c.dst] = list(self.kv[c.src])
        for _, loads, _ in orders:
            for c in loads:
                assert self.host_kv.get(c.src) == self.content[self.pool.host.blocks.block_hash[c.src]]
                self.kv[c.dst] = list(self.host_kv[c.src])
        taken = set(ran[-1][1]) if len(ran) == 2 else set()  # A's blocks B holds now: B's loads and writes
        for rid, blocks, cached, num_tokens in ran:
            for pos in range(cached, num_tokens):
                if rid != first or blocks[pos // BS] not in taken:
                    self.kv[blocks[pos // BS]][pos % BS] = self.tokens[rid][pos]
        for _, _, writes in orders:
            self._write_through(writes)
        self.pool.end_step()
        self.tokens.pop(first, None)

    @rule(n=st.integers(0, 3))
    def evict_host(self, n):
        free_hashed = self.pool.host.blocks.free_queue.num_hashed()
        assert self.pool.evict(n, "host") == min(n, free_hashed)

    @rule()
    def reset_host(self):
        self.host_reset = True
        assert self.pool.reset_prefix_cache("host") is True  # between steps nothing is pinned

    @invariant()
    def host_blocks_hold_their_tokens(self):
        host = self.pool.host.blocks
        for b in range(1, self.HOST_BLOCKS):
            h = host.block_hash[b]
            if h is not None:
                assert self.host_kv.get(b) == self.content[h], f"host block {b} holds other tokens than its hash"


HostPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestHostPoolMachine = HostPoolMachine.TestCase


class WriteThroughPoolMachine(HostPoolMachine):
    HOST_POLICY = "write_through"

    @invariant()
    def a_full_block_is_in_the_host_tier_unless_host_capacity_ran_out(self):
        # write-through: every hash cached on the device was given a host block when it became
        # full, so the host lacks one only once host LRU, an admin evict or reset, or a host
        # with every block pinned (saves_dropped) lost some hash
        host = self.pool.host
        if host.stats.saves_dropped == 0 and host.blocks.num_evictions == 0 and not self.host_reset:
            missing = set(self.pool.blocks.cached) - set(host.blocks.cached)
            assert not missing, f"{len(missing)} device hashes never written through"


WriteThroughPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWriteThroughPoolMachine = WriteThroughPoolMachine.TestCase
