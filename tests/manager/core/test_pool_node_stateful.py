"""Two pools sharing one node tier, random operation sequences, simulated device memory, host
memory and disk as the model (manager/core/pool_node.py, node_tier.py).

The machine plays both workers: each rule is one step of one pool, whose node-tier orders run as
a worker runs them (``pre`` in order before the step's writes, then the writes, then ``post``),
verifying every read: a slot holds (key, tokens, whole); a read of another key or a slot that is
not whole (``corrupt`` flips one, as a torn write or a bad disk would) fails, the block is
recomputed and the order reported failed. Batches are reported one step late, as a worker with
overlap reports them. After every step:
- both pools' invariants and the tier's hold;
- every request reads back exactly its own tokens (a load never serves another block's tokens,
  whichever pool computed it);
- every cached device block and every readable, whole node slot holds its hash's tokens.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.manager.core.node_snapshot import dump_tier, load_tier
from kvpool.manager.core.node_tier import NodeTier
from kvpool.manager.core.pool import Pool
from kvpool.shared.hashing import hash_blocks
from kvpool.shared.node_orders import Load, Save

BS = 4
DEVICE = 10
prefix_st = st.sampled_from([[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 2, 2], [2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2, 2]])
prompt_st = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class NodePoolMachine(RuleBasedStateMachine):
    POLICY = "demote"

    def __init__(self):
        super().__init__()
        self.tier = NodeTier(6, 8, BS, 64, policy=self.POLICY)
        self.pools = [Pool(DEVICE, BS), Pool(DEVICE, BS)]
        for p in self.pools:
            p.set_node(self.tier)
        self.kv = [{b: [None] * BS for b in range(DEVICE)} for _ in self.pools]
        self.slots: dict[tuple[str, int], tuple[bytes, list, bool]] = {}  # (level, slot) -> key, tokens, whole
        self.tokens: list[dict[int, list[int]]] = [{}, {}]
        self.content: dict[bytes, list[int]] = {}
        self.next_id = 0
        self.step_no = 0
        self.unreported: list[tuple[tuple, list]] = []  # (owner, failed): reported at the next step

    # -- the simulated worker ----------------------------------------------------------------

    def _read(self, level: str, slot: int, key: bytes) -> list | None:
        got = self.slots.get((level, slot))
        if got is None or got[0] != key or not got[2]:  # what the checksum and the key tell a reader
            return None
        return list(got[1])

    def _run(self, i: int, orders: list, failed: list, unwritten: set[int]) -> None:
        kv = self.kv[i]
        for o in orders:
            if type(o) is Save and o.to == "host":
                self.slots[("host", o.dst)] = (o.key, list(kv[o.src]), True)
                continue
            src = ("host" if type(o) is Save else o.frm, o.src)
            got = self._read(*src, o.key)
            if got is None:
                failed.append(o)
                if type(o) is Load and o.frm == "host":
                    unwritten.add(o.dst)
                    kv[o.dst] = [None] * BS
                continue
            if type(o) is Save:
                self.slots[("disk", o.dst)] = (o.key, got, True)
            elif o.frm == "disk":
                self.slots[("host", o.dst)] = (o.key, got, True)
            else:
                kv[o.dst] = got

    def _step(self, i: int, admit) -> None:
        """One step of pool ``i``: ``admit(pool)`` runs its sub-op and returns (rid, start) or None."""
        pool = self.pools[i]
        self.step_no += 1
        for owner, failed in self.unreported:
            self.tier.finish(owner, failed)
        self.unreported = []
        pool.node.owner = (i, self.step_no)
        got = admit(pool)
        pre, post = pool.node.take_orders()
        failed: list = []
        unwritten: set[int] = set()
        self._run(i, pre, failed, unwritten)
        if got is not None:
            rid, start = got
            req = pool.requests[rid]
            first = next((k for k, b in enumerate(req.blocks[: start // BS]) if b in unwritten), None)
            if first is not None:
                start = first * BS  # recomputed, never served
            for pos in range(start, req.num_tokens):
                b = req.blocks[pos // BS]
                assert pool.blocks.ref_cnt[b] == 1, f"write into shared block {b}"
                self.kv[i][b][pos % BS] = self.tokens[i][rid][pos]
        self._run(i, post, failed, set())
        pool.end_step()
        if (i, self.step_no) in self.tier.batches:
            self.unreported.append(((i, self.step_no), failed))

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        hashes = hash_blocks(tokens, BS)
        for k, h in enumerate(hashes):
            self.content[h] = tokens[k * BS:(k + 1) * BS]
        return hashes

    # -- rules ------------------------------------------------------------------------------

    @rule(i=st.integers(0, 1), prefix=prefix_st, prompt=prompt_st, chunk=st.integers(1, 24))
    def allocate(self, i, prefix, prompt, chunk):
        rid, self.next_id = self.next_id, self.next_id + 1
        tokens = prefix + prompt

        def admit(pool):
            res = pool.allocate(rid, self._hashes(tokens), len(tokens), chunk, 0)
            if res is None:
                return None
            self.tokens[i][rid] = tokens
            return rid, res[0]

        self._step(i, admit)

    @precondition(lambda self: self.tokens[0] or self.tokens[1])
    @rule(data=st.data(), grow=st.integers(1, 9))
    def extend(self, data, grow):
        i = data.draw(st.sampled_from([k for k in (0, 1) if self.tokens[k]]))
        rid = data.draw(st.sampled_from(sorted(self.tokens[i])))
        toks = self.tokens[i][rid]

        def admit(pool):
            req = pool.requests[rid]
            old, new_len = req.num_tokens, req.num_tokens + grow
            if new_len > len(toks):
                toks.extend(data.draw(st.lists(st.integers(0, 2), min_size=new_len - len(toks),
                                               max_size=new_len - len(toks))))
            known = len(req.hashes)
            new = self._hashes(toks[:new_len])[known:] if new_len // BS > known else []
            res = pool.extend(rid, new_len, new, 0)
            if res is None:
                return None
            for _, src, dst in res[1]:
                self.kv[i][dst] = list(self.kv[i][src])
            return rid, old

        self._step(i, admit)

    @precondition(lambda self: self.tokens[0] or self.tokens[1])
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.sampled_from([k for k in (0, 1) if self.tokens[k]]))
        rid = data.draw(st.sampled_from(sorted(self.tokens[i])))
        self.pools[i].free(rid)
        del self.tokens[i][rid]

    @rule(level=st.sampled_from(["host", "disk"]), data=st.data())
    def corrupt(self, level, data):
        held = sorted(b for (lv, b) in self.slots if lv == level)
        if held:
            b = data.draw(st.sampled_from(held))
            key, tokens, _ = self.slots[(level, b)]
            self.slots[(level, b)] = (key, [-1] * BS, False)  # torn: served as is, another request's K/V

    @rule(level=st.sampled_from(["host", "disk"]), n=st.integers(0, 4))
    def evict_level(self, level, n):
        self.tier.evict(level, n)

    @rule(prefix=prefix_st.filter(bool), ttl=st.integers(1, 30))
    def pin(self, prefix, ttl):
        self.tier.pin(self._hashes(prefix), ttl, self.step_no)  # refused past the share: no change

    @rule()
    def expire_pins(self):
        self.tier.expire(self.step_no)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self):
        for p in self.pools:
            p.check_invariants()
        self.tier.check_invariants()

    @invariant()
    def the_tier_survives_its_snapshot(self):
        """What a state snapshot keeps of the tier loads back whole and dumps the same."""
        dump = dump_tier(self.tier)
        back = load_tier(dump)
        back.check_invariants()
        assert dump_tier(back) == dump

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for i, pool in enumerate(self.pools):
            for rid, req in pool.requests.items():
                for pos in range(req.num_tokens):
                    assert self.kv[i][req.blocks[pos // BS]][pos % BS] == self.tokens[i][rid][pos], (i, rid, pos)

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for i, pool in enumerate(self.pools):
            for b in range(1, DEVICE):
                h = pool.blocks.block_hash[b]
                if h is not None:
                    assert self.kv[i][b] == self.content[h], f"pool {i} block {b}"
        for name, lv in self.tier.levels.items():
            for h in lv.blocks.cached:
                b = lv.readable(h)
                if b is not None and self.slots[(name, b)][2]:  # a torn slot fails its reader's check
                    assert self.slots[(name, b)][:2] == (h, self.content[h]), f"{name} slot {b}"


NodePoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestNodePoolMachine = NodePoolMachine.TestCase


class WriteThroughNodePoolMachine(NodePoolMachine):
    POLICY = "write_through"


WriteThroughNodePoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestWriteThroughNodePoolMachine = WriteThroughNodePoolMachine.TestCase
