"""The host tier (manager/core/host_tier.py): demotion, loads, pins within a step, LRU, and a
state machine that executes every step's orders on simulated device and host memories."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.host_tier import Copy, HostTier
from kvpool.manager.core.kv_events import BlockRemoved, BlockStored


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_demote_saves_once_and_a_known_hash_copies_nothing():
    t = HostTier(4, 16, enable_events=True)
    assert t.demote(7, h(1), None) == Copy(7, 1)
    assert t.demote(9, h(1), None) is None and t.stats.saves_skipped == 1
    t.end_step()
    assert t.lookup([h(1), h(2)]) == [1] and t.take_events() == [BlockStored([h(1)], None, "CPU")]
    t.check_invariants()


def test_the_host_tier_evicts_in_lru_order_and_a_resave_refreshes():
    t = HostTier(4, 16, enable_events=True)  # 3 usable host blocks
    for i in (1, 2, 3):
        t.demote(i, h(i), None)
    t.end_step()
    t.demote(5, h(1), None)  # h(1) again: most recently used, h(2) is now the LRU
    assert t.demote(6, h(4), None) == Copy(6, 2)
    t.end_step()
    assert t.lookup([h(2)]) == [] and t.lookup([h(1)]) == [1]
    assert BlockRemoved([h(2)], "CPU") in t.take_events()
    t.check_invariants()


def test_no_save_reuses_a_host_block_a_load_of_the_same_step_reads():
    t = HostTier(3, 16)  # 2 usable host blocks
    t.demote(1, h(1), None)
    t.demote(2, h(2), None)
    t.end_step()
    t.pin(t.lookup([h(1)]))
    assert t.load([1], [9]) == [Copy(1, 9)]
    assert t.demote(3, h(3), None) == Copy(3, 2)  # h(2)'s block, never the pinned one
    assert t.demote(4, h(4), None) is None and t.stats.saves_dropped == 1  # all pinned: lost
    t.check_invariants()
    t.end_step()
    assert t.lookup([h(1)]) == [1] and t.lookup([h(3)]) == [2]
    t.check_invariants()


def test_reset_is_refused_while_pinned_and_evict_drops_lru_first():
    t = HostTier(4, 16)
    t.demote(1, h(1), None)
    assert t.reset() is False
    t.demote(2, h(2), None)
    t.end_step()
    assert t.evict(1) == 1 and t.lookup([h(1)]) == [] and t.lookup([h(2)]) == [2]
    assert t.reset() is True and t.lookup([h(2)]) == []


def test_host_events_name_the_cpu_medium_and_a_host_reset_removes_only_host_hashes():
    from kvpool.manager.events import encode_events

    t = HostTier(4, 16, enable_events=True)
    t.demote(1, h(1), None)
    t.end_step()
    assert t.reset() is True
    events = t.take_events()
    assert events == [BlockStored([h(1)], None, "CPU"), BlockRemoved([h(1)], "CPU")]
    assert [e["medium"] for e in encode_events(events, 16)] == ["CPU", "CPU"]
    assert encode_events(events, 16, "vllm-0.11")[1] == ["BlockRemoved", [h(1)], "CPU"]
    assert t.reset() is True and t.take_events() == []  # an empty tier: nothing to remove


def test_a_pin_the_step_forgot_breaks_the_invariants():
    t = HostTier(4, 16)
    t.demote(1, h(1), None)
    t.pinned.clear()  # a bug: the pin is lost but the block still holds a reference
    with pytest.raises(InvariantBroken, match="pins"):
        t.check_invariants()
    with pytest.raises(ValueError, match="device blocks"):
        t.load([1], [])
    with pytest.raises(InvariantBroken, match="without a pin"):
        t.load([2], [5])


def test_a_write_is_unreadable_until_its_step_ends_and_a_withdrawn_one_loses_its_hash():
    t = HostTier(4, 16)
    c = t.write(7, h(1), None)
    assert c == Copy(7, c.dst) and t.lookup([h(1)]) == []  # written after the forward: no load yet
    assert t.write(8, h(1), None) is None and t.stats.writes_skipped == 1
    t.check_invariants()
    t.end_step()
    assert t.lookup([h(1)]) == [c.dst] and t.stats.writes == 1
    c2 = t.write(9, h(2), h(1))
    t.withdraw(9)  # device block 9 reused within the step: its write would copy other tokens
    assert t.lookup([h(2)]) == [] and h(2) not in t.blocks.cached and t.stats.writes_withdrawn == 1
    t.check_invariants()
    t.end_step()
    assert t.blocks.ref_cnt[c2.dst] == 0 and t.blocks.block_hash[c2.dst] is None
    t.check_invariants()


def test_a_write_and_its_withdrawal_are_cpu_events():
    t = HostTier(4, 16, enable_events=True)
    t.write(3, h(1), None)
    t.write(4, h(2), h(1))
    t.withdraw(4)
    assert t.take_events() == [BlockStored([h(1)], None, "CPU"), BlockStored([h(2)], h(1), "CPU"),
                               BlockRemoved([h(2)], "CPU")]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="write_through"):
        HostTier(4, 16, policy="write-back")


class HostTierMachine(RuleBasedStateMachine):
    """Orders executed the way the worker executes them: every save of a step, then every
    load, then the forward (which computes the blocks being written through), then every
    write, against simulated memories holding which hash each block's contents stand for."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(4, 4)
        self.device: dict[int, bytes] = {}  # device block -> the tokens (hash) it holds
        self.host: dict[int, bytes] = {}  # host block -> the tokens it holds
        self.saves: list[Copy] = []
        self.loads: list[tuple[Copy, bytes]] = []
        self.writes: list[Copy] = []
        self.computed: dict[int, bytes] = {}  # device block -> what this step's forward writes there
        self.next_device = 1

    def _fresh_device_block(self, content: bytes | None) -> int:
        d, self.next_device = self.next_device, self.next_device + 1
        if content is not None:
            self.device[d] = content
        return d

    @rule(i=st.integers(0, 5))
    def evict_device_block(self, i: int) -> None:
        copy = self.tier.demote(self._fresh_device_block(h(i)), h(i), None)
        if copy is not None:
            self.saves.append(copy)

    @rule(chain=st.lists(st.integers(0, 5), min_size=1, max_size=3))
    def allocate_with_host_hits(self, chain: list[int]) -> None:
        hashes = [h(i) for i in chain]
        hits = self.tier.lookup(hashes)
        self.tier.pin(hits)
        dst = [self._fresh_device_block(None) for _ in hits]
        for copy, hb in zip(self.tier.load(hits, dst), hits):
            self.loads.append((copy, self.tier.blocks.block_hash[hb]))

    @rule(i=st.integers(0, 5))
    def block_becomes_full(self, i: int) -> None:
        d = self._fresh_device_block(None)
        self.computed[d] = h(i)
        copy = self.tier.write(d, h(i), None)
        if copy is not None:
            self.writes.append(copy)

    @precondition(lambda self: self.computed)
    @rule(data=st.data())
    def reuse_a_block_full_this_step(self, data) -> None:
        d = data.draw(st.sampled_from(sorted(self.computed)))
        self.tier.withdraw(d)
        self.computed[d] = h(99)  # the forward writes another request's tokens there

    @rule()
    def run_step(self) -> None:
        for c in self.saves:
            self.host[c.dst] = self.device[c.src]
        for c, want in self.loads:
            if self.host.get(c.src) != want:
                raise AssertionError(f"load of host block {c.src} read {self.host.get(c.src)!r:.20}, not its hash")
            self.device[c.dst] = self.host[c.src]
        self.device.update(self.computed)
        for c in self.writes:
            self.host[c.dst] = self.device[c.src]
        self.saves, self.loads, self.writes, self.computed = [], [], [], {}
        self.tier.end_step()

    @rule(n=st.integers(0, 3))
    def admin_evict(self, n: int) -> None:
        self.tier.evict(n)

    @invariant()
    def holds(self) -> None:
        self.tier.check_invariants()
        if not self.saves and not self.writes:  # between steps every cached host block holds its hash's tokens
            for hsh, hb in self.tier.blocks.cached.items():
                if self.host.get(hb) != hsh:
                    raise AssertionError(f"host block {hb} does not hold the hash it is mapped under")


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
