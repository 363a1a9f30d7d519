"""The node tier (manager/core/node_tier.py): exact orders of saves, write-downs, loads and
prefetches under each policy, batches and failures, retention (pins, TTL, the share bound,
priorities), and a state machine running every batch's orders on simulated host memory and disk."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.manager.core.block_pool import InvariantBroken
from kvpool.manager.core.kv_events import BlockRemoved, BlockStored
from kvpool.manager.core.node_tier import Hit, NodeTier, Removal
from kvpool.manager.core.retention import PinRefused
from kvpool.shared.node_orders import Load, Save, order_from_wire
from kvpool.shared.protocol import ManagerError


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def make_tier(host: int = 4, disk: int = 4, **kw) -> NodeTier:
    return NodeTier(host, disk, 16, 1024, **kw)


def fill(t: NodeTier, owner: object, keys: list[int], priority: int = 0) -> list:
    """One batch per block (a batch references every slot it writes until it finishes)."""
    out = []
    for i in keys:
        out += t.save(owner, 100 + i, h(i), None, priority)
        t.finish(owner)
        t.check_invariants()
    return out


def test_a_save_lands_at_finish_and_a_known_hash_is_skipped():
    t = make_tier(enable_events=True)
    assert t.save("a", 7, h(1), None) == [Save("host", 7, 1, h(1))]
    assert t.lookup([h(1)]) == []  # landing: its bytes may not be there yet
    assert t.save("b", 9, h(1), None) == [] and t.host.stats.saves_skipped == 1
    t.check_invariants()
    t.finish("a")
    assert t.lookup([h(1), h(2)]) == [Hit("host", 1, h(1))]
    assert t.take_events() == [BlockStored([h(1)], None, "CPU")]
    t.check_invariants()


def test_demote_writes_the_lru_host_block_down_before_its_slot_is_reused():
    t = make_tier()  # 3 usable host slots
    fill(t, "a", [1, 2, 3])
    assert t.save("b", 50, h(4), None) == [Save("disk", 1, 1, h(1)), Save("host", 50, 1, h(4))]
    t.finish("b")
    assert t.take_removals() == [Removal("host", h(1), "demoted")]
    assert t.lookup([h(1), h(4)]) == [Hit("disk", 1, h(1)), Hit("host", 1, h(4))]
    t.check_invariants()


def test_demote_admits_to_disk_by_hit_count():
    t = make_tier(admit_hits=1)
    fill(t, "a", [1, 2, 3])
    hit = t.lookup([h(2)])
    t.hold("l", hit)
    assert t.load("l", hit, [60]) == [Load("host", 2, 60, h(2))]
    t.finish("l")
    # h(1) was never hit: evicted without a disk write; h(2) hit once: written down
    assert t.save("b", 50, h(4), None) == [Save("host", 50, 1, h(4))]
    assert t.save("b", 51, h(5), None) == [Save("host", 51, 3, h(5))]  # h(3): the LRU now, never hit
    assert t.save("b", 52, h(6), None) == [Save("disk", 2, 1, h(2)), Save("host", 52, 2, h(6))]
    t.finish("b")
    assert [r.reason for r in t.take_removals()] == ["evicted", "evicted", "demoted"]
    t.check_invariants()


def test_write_through_writes_every_save_down_in_the_same_batch():
    t = make_tier(policy="write_through")
    assert t.save("a", 7, h(1), None) == [Save("host", 7, 1, h(1)), Save("disk", 1, 1, h(1))]
    t.finish("a")
    fill(t, "b", [2, 3])
    assert t.save("c", 8, h(4), None) == [Save("host", 8, 1, h(4)), Save("disk", 1, 1, h(4))]
    # h(1) leaves host memory with no write-down (the disk holds it: demoted), then the disk
    # level (its LRU) for h(4)'s write-down
    t.finish("c")
    assert t.take_removals() == [Removal("host", h(1), "demoted"), Removal("disk", h(1), "evicted")]
    t.check_invariants()


def test_write_through_selective_writes_down_at_the_second_hit():
    t = make_tier(policy="write_through_selective")
    fill(t, "a", [1])
    orders = []
    for step in range(3):
        hit = t.lookup([h(1)])
        t.hold(step, hit)
        orders.append(t.load(step, hit, [70 + step]))
        t.finish(step)
    assert orders == [[Load("host", 1, 70, h(1))], [Load("host", 1, 71, h(1)), Save("disk", 1, 1, h(1))],
                      [Load("host", 1, 72, h(1))]]
    assert t.lookup([h(1)]) == [Hit("host", 1, h(1))] and t.disk.readable(h(1)) == 1
    t.check_invariants()


def test_prefetch_brings_a_disk_block_up_readable_once_its_batch_finishes():
    t = make_tier()
    fill(t, "a", [1, 2, 3, 4])  # h(1) demoted to disk slot 1
    hits = t.lookup([h(1), h(2)])
    assert hits == [Hit("disk", 1, h(1)), Hit("host", 2, h(2))]
    assert t.prefetch("p", hits) == [Save("disk", 2, 2, h(2)), Load("disk", 1, 2, h(1))]
    assert t.lookup([h(1)]) == [Hit("disk", 1, h(1))]  # the host copy is landing
    t.finish("p")
    assert t.lookup([h(1), h(2)]) == [Hit("host", 2, h(1)), Hit("disk", 2, h(2))]
    assert t.disk.stats.hits == 1
    t.check_invariants()


def test_a_prefetched_disk_slot_is_not_the_victim_of_the_write_down_its_host_slot_needs():
    t = make_tier(host=3, disk=3)  # 2 usable slots each
    fill(t, "a", [1, 2, 3, 4])  # disk: h(1)@1, h(2)@2; host: h(3)@1, h(4)@2
    assert t.lookup([h(1)]) == [Hit("disk", 1, h(1))]
    # h(3) leaves host slot 1 for h(1) and is written down: into disk slot 2 (h(2), evicted),
    # never slot 1, the LRU one, which this very prefetch reads
    assert t.prefetch("p", t.lookup([h(1)])) == [Save("disk", 1, 2, h(3)), Load("disk", 1, 1, h(1))]
    t.finish("p")
    assert t.lookup([h(1), h(3)]) == [Hit("host", 1, h(1)), Hit("disk", 2, h(3))]
    t.check_invariants()


def test_a_held_slot_is_never_a_victim_and_a_full_level_drops_the_save():
    t = make_tier(host=3, disk=0)
    fill(t, "a", [1, 2])
    hits = t.lookup([h(1)])
    t.hold("l", hits)
    assert t.save("s", 9, h(3), None) == [Save("host", 9, 2, h(3))]  # h(2)'s slot, not the held one
    assert t.save("s", 10, h(4), None) == [] and t.host.stats.saves_dropped == 1
    t.check_invariants()
    t.finish("l")
    t.finish("s")
    assert t.lookup([h(1)]) == hits and t.lookup([h(3)]) == [Hit("host", 2, h(3))]
    with pytest.raises(InvariantBroken, match="without a hold"):
        t.load("x", hits, [5])


def test_failed_orders_leave_the_tier_counted_per_level():
    t = make_tier()
    fill(t, "a", [1, 2, 3, 4])  # h(1) on disk slot 1
    bad_save = t.save("b", 9, h(5), None)
    t.finish("b", failed=[bad_save[-1]])  # the host save did not land
    assert t.lookup([h(5)]) == [] and t.host.stats.save_failures == 1
    hits = t.lookup([h(1)])
    orders = t.prefetch("p", hits)
    t.finish("p", failed=[orders[-1]])  # the disk block did not verify: gone from both levels
    assert t.lookup([h(1)]) == [] and t.disk.stats.verify_failures == 1
    assert [r for r in t.take_removals() if r.reason == "failed"] == [
        Removal("host", h(5), "failed"), Removal("disk", h(1), "failed"), Removal("host", h(1), "failed")]
    with pytest.raises(ValueError, match="not an order"):
        t.save("c", 9, h(6), None)
        t.finish("c", failed=[Save("host", 1, 1, h(99))])
    t.check_invariants()


def test_a_late_disk_load_leaves_both_levels_as_a_deadline_miss_not_a_verify_failure():
    t = make_tier()
    fill(t, "a", [1, 2, 3, 4])  # h(1) on disk slot 1
    hits = t.lookup([h(1)])
    orders = t.prefetch("p", hits)
    prefetch = orders[-1]
    assert isinstance(prefetch, Load) and prefetch.frm == "disk"
    t.finish("p", late=[prefetch])  # the read missed the worker's deadline
    assert t.lookup([h(1)]) == []  # a slot a read hung on is not tried again
    assert (t.disk.stats.deadline_misses, t.disk.stats.verify_failures) == (1, 0)
    assert t.usage()["disk"]["deadline_misses"] == 1
    w = make_tier(policy="write_through")  # a late write-down leaves the disk level, the host copy stays
    (write_down,) = [o for o in w.save("w", 9, h(7), None) if isinstance(o, Save) and o.to == "disk"]
    w.finish("w", late=[write_down])
    assert w.disk.readable(h(7)) is None and w.lookup([h(7)])[0].level == "host"
    assert (w.disk.stats.deadline_misses, w.disk.stats.save_failures) == (1, 0)
    w.check_invariants()
    with pytest.raises(ValueError, match="has no batch"):
        t.finish("q", late=[prefetch])  # no batch: refused
    t.check_invariants()


def test_abandon_drops_what_the_batch_was_writing():
    t = make_tier()
    t.save("a", 7, h(1), None)
    fill(t, "b", [2])
    hits = t.lookup([h(2)])
    t.hold("a", hits)
    t.abandon("a")
    assert t.lookup([h(1)]) == [] and t.lookup([h(2)]) == hits
    assert t.take_removals() == [Removal("host", h(1), "failed")]
    t.check_invariants()


def test_priorities_evict_the_least_important_class_first_then_lru():
    t = make_tier(host=5, disk=0)
    fill(t, "a", [1], priority=0)
    fill(t, "a", [2], priority=5)  # vLLM's order: a larger value is less important
    fill(t, "a", [3], priority=0)
    fill(t, "a", [4], priority=5)
    evicted = []
    for i in (10, 11, 12):
        t.save("b", i, h(i), None, priority=0)
        t.finish("b")
        evicted += [r.key for r in t.take_removals()]
    assert evicted == [h(2), h(4), h(1)]  # class 5 in LRU order, then class 0's LRU
    t.save("b", 13, h(13), None, priority=3)
    t.finish("b")
    t.save("b", 14, h(14), None, priority=0)
    t.finish("b")
    assert [r.key for r in t.take_removals()] == [h(3), h(13)]  # class 3 before class 0
    t.check_invariants()


def test_a_hit_by_a_more_important_request_raises_a_blocks_priority():
    t = make_tier(host=3, disk=0)
    fill(t, "a", [1, 2], priority=5)
    hit = t.lookup([h(1)])
    t.hold("l", hit)
    t.load("l", hit, [9], priority=0)
    t.finish("l")
    t.save("b", 9, h(3), None, priority=5)
    t.finish("b")
    assert [r.key for r in t.take_removals()] == [h(2)]


def test_pins_hold_under_pressure_and_expire_into_lru():
    t = make_tier(host=5, disk=0, pin_share=0.5)  # 4 usable slots, at most 2 pinned hashes
    fill(t, "a", [1, 2])
    pin = t.pin([h(1), h(2)], ttl_s=60, now=0.0)
    assert pin == 1 and t.list_pins(10.0)[0].remaining_s == 50.0
    for i in range(3, 9):
        fill(t, "b", [i])
    assert t.lookup([h(1), h(2)]) == [Hit("host", 1, h(1)), Hit("host", 2, h(2))]
    assert t.expire(59.0) == [] and t.expire(60.0) == [1] and t.list_pins(61.0) == []
    t.check_invariants()
    assert [r.key for r in t.take_removals()] == [h(3), h(4), h(5), h(6)]  # the two unpinned slots, LRU
    fill(t, "c", [20, 21, 22])  # expired pins join their class's MRU end: h(7), h(8) go first
    assert [(r.key, r.reason) for r in t.take_removals()] == [
        (h(7), "evicted"), (h(8), "evicted"), (h(1), "expired_pin")]
    t.check_invariants()


def test_a_pin_retains_a_hash_saved_after_it_and_the_share_bound_refuses_with_the_figure():
    t = make_tier(host=9, disk=5, pin_share=0.5)  # host: 8 usable, 4 pinned; disk: 4 usable, 2 pinned
    assert t.pin([h(1)], 30, now=0.0) == 1
    t.save("a", 5, h(1), None)
    assert t.host.retained == {1}
    t.finish("a")
    refused = t.pin([h(2), h(3)], 30, now=0.0)
    assert refused == PinRefused("disk", 2, 1, 2, 0.5, 4)
    assert "adds 2 blocks to the 1 pinned in the disk level" in refused.message and "at most 2" in refused.message
    assert len(t.pins.pins) == 1 and t.pin([h(1), h(2)], 30, now=0.0) == 2  # h(1) counts once
    assert t.unpin(1) and t.host.retained == {1} and not t.unpin(1)  # pin 2 still names h(1)
    t.check_invariants()


def test_admin_evict_and_reset_name_their_reasons_and_reset_waits_for_batches():
    t = make_tier(enable_events=True)
    fill(t, "a", [1, 2, 3, 4])  # h(1) demoted to disk
    assert t.evict("host", 1) == 1  # h(2): LRU
    t.save("b", 9, h(7), None)
    assert t.reset("host") is False
    t.finish("b")
    assert t.reset("host") is True and t.lookup([h(3)]) == []
    reasons = [(r.key, r.reason) for r in t.take_removals()]
    assert reasons[:2] == [(h(1), "demoted"), (h(2), "evicted")] and (h(3), "cleared") in reasons
    assert BlockRemoved([h(3), h(4), h(7)], "CPU") in t.take_events()
    with pytest.raises(ValueError, match="no 'tape' level"):
        t.evict("tape", 1)


def test_bad_configurations_and_orders_are_refused():
    with pytest.raises(ValueError, match="policy"):
        make_tier(policy="write_back")
    with pytest.raises(ValueError, match="admit_hits"):
        make_tier(policy="write_through", admit_hits=2)
    o = Load("disk", 3, 4, h(1))
    assert order_from_wire(o.to_wire()) == o
    with pytest.raises(ManagerError, match="order.level"):
        order_from_wire({**o.to_wire(), "level": "tape"})
    with pytest.raises(ManagerError, match="order.key"):
        order_from_wire({**o.to_wire(), "key": b"short"})
    with pytest.raises(ManagerError, match="order.src"):
        order_from_wire({**o.to_wire(), "src": 0})


KEYS = st.integers(0, 9)
OWNERS = st.integers(0, 2)  # e.g. three pools' steps, each with its batch open or not
DONE = st.sampled_from([True, True, False])  # most calls' batches finish at once


class NodeTierMachine(RuleBasedStateMachine):
    """Several owners' batches open at once; each batch's calls run at a moment of its own
    choosing before its finish, each call's orders in their order, against simulated host
    memory and disk that record (key, bytes) per slot as the real store does. Every load must
    read the bytes of the hash it names, unless the test corrupted that slot (then the load is
    a verify failure and reported so)."""

    POLICY = "demote"

    def __init__(self) -> None:
        super().__init__()
        self.tier = NodeTier(5, 6, 4, 64, policy=self.POLICY, pin_share=0.4)
        self.mem: dict[str, dict[int, tuple[bytes, bytes]]] = {"host": {}, "disk": {}}
        self.device: dict[int, bytes] = {}
        self.pending: dict[int, list[list]] = {}  # owner -> its calls' orders, not run yet
        self.failed: dict[int, list] = {}  # owner -> its orders that did not verify
        self.corrupt: set[tuple[str, int]] = set()
        self.next_dev, self.now = 1000, 0.0

    @rule(o=OWNERS, keys=st.lists(KEYS, min_size=1, max_size=3), done=DONE)
    def save(self, o, keys, done):
        for k in keys:
            d, self.next_dev = self.next_dev, self.next_dev + 1
            self.device[d] = b"tokens" + h(k)
            self.pending.setdefault(o, []).append(self.tier.save(o, d, h(k), None, priority=k % 3))
        if done:
            self.finish(o)

    @rule(o=OWNERS, data=st.data(), tail=st.lists(KEYS, max_size=2), done=DONE)
    def load_or_prefetch(self, o, data, tail, done):
        readable = sorted({k for k in range(10) for lv in self.tier.levels.values() if lv.readable(h(k))})
        chain = [data.draw(st.sampled_from(readable))] if readable else []
        hits = self.tier.lookup([h(k) for k in chain + tail])
        self.tier.hold(o, hits)
        host = [x for x in hits if x.level == "host"]
        devs = list(range(self.next_dev, self.next_dev + len(host)))
        self.next_dev += len(host)
        self.pending.setdefault(o, []).append(self.tier.load(o, host, devs) + self.tier.prefetch(o, hits))
        if done:
            self.finish(o)

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def run_one_call(self, data):
        o = data.draw(st.sampled_from(sorted(k for k, v in self.pending.items() if v)))
        calls = self.pending[o]
        for order in calls.pop(data.draw(st.integers(0, len(calls) - 1))):
            self._run(o, order)

    def _run(self, o, order):
        if isinstance(order, Save):
            src = self.device[order.src] if order.to == "host" else self._read(o, order, "host", order.src)
            if src is not None:
                self.mem[order.to][order.dst] = (order.key, src)
                self.corrupt.discard((order.to, order.dst))
            return
        got = self._read(o, order, order.frm, order.src)
        if got is None:
            return
        if order.frm == "host":
            self.device[order.dst] = got
        else:
            self.mem["host"][order.dst] = (order.key, got)
            self.corrupt.discard(("host", order.dst))

    def _read(self, o, order, level, slot):
        """The verified bytes, or None with the order reported failed (a corrupted slot only)."""
        key, data = self.mem[level].get(slot, (None, None))
        if (level, slot) in self.corrupt:
            self.failed.setdefault(o, []).append(order)
            return None
        assert key == order.key and data == b"tokens" + order.key, f"{order} reads {key!r:.12}"
        return data

    @rule(o=OWNERS)
    def finish(self, o):
        for call in self.pending.pop(o, []):
            for order in call:
                self._run(o, order)
        self.tier.finish(o, self.failed.pop(o, []))

    @rule(o=OWNERS)
    def abandon(self, o):
        self.pending.pop(o, None)  # its orders ran in part or not at all
        self.failed.pop(o, None)
        self.tier.abandon(o)

    @rule(level=st.sampled_from(["host", "disk"]), data=st.data())
    def corrupt_a_slot(self, level, data):
        held = sorted(self.mem[level])
        if held:
            self.corrupt.add((level, data.draw(st.sampled_from(held))))

    @rule(chain=st.lists(KEYS, min_size=1, max_size=2), ttl=st.integers(1, 5))
    def pin(self, chain, ttl):
        self.tier.pin([h(k) for k in chain], ttl, self.now)

    @rule(dt=st.integers(0, 3))
    def tick(self, dt):
        self.now += dt
        self.tier.expire(self.now)

    @rule(level=st.sampled_from(["host", "disk"]), n=st.integers(0, 2))
    def admin_evict(self, level, n):
        self.tier.evict(level, n)

    @invariant()
    def holds(self):
        self.tier.check_invariants()
        for r in self.tier.take_removals():
            if r.reason in ("evicted", "demoted", "expired_pin"):
                assert not self.tier.pins.is_pinned(r.key), f"pinned {r.key[-1]} left {r.level}: {r.reason}"
        # a readable slot holds its hash's bytes, unless it was corrupted (the load reports it)
        for name, lv in self.tier.levels.items():
            for key, b in lv.blocks.cached.items():
                if lv.readable(key) == b and (name, b) not in self.corrupt:
                    assert self.mem[name].get(b) == (key, b"tokens" + key), f"{name} slot {b}"


NodeTierMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestNodeTierMachine = NodeTierMachine.TestCase


class WriteThroughMachine(NodeTierMachine):
    POLICY = "write_through"


WriteThroughMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestWriteThroughMachine = WriteThroughMachine.TestCase


class SelectiveMachine(NodeTierMachine):
    POLICY = "write_through_selective"


SelectiveMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestSelectiveMachine = SelectiveMachine.TestCase


def test_a_save_from_the_private_host_tier_says_so_on_the_wire_and_nothing_else_may():
    save = Save("host", 3, 5, h(1), "private")
    assert save.to_wire()["source"] == "private" and order_from_wire(save.to_wire()) == save
    assert "source" not in Save("host", 3, 5, h(1)).to_wire()
    for bad in ({"op": "load", "level": "host", "src": 1, "dst": 1, "key": h(1), "source": "private"},
                {"op": "save", "level": "disk", "src": 1, "dst": 1, "key": h(1), "source": "private"},
                {"op": "save", "level": "host", "src": 1, "dst": 1, "key": h(1), "source": "nvme"}):
        with pytest.raises(ManagerError, match="order.source"):
            order_from_wire(bad)
    t = make_tier()
    assert t.save("a", 3, h(1), None, source="private") == [save.__class__("host", 3, 1, h(1), "private")]
