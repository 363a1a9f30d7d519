"""KV events leave a pool once, through take_events; restate_events resynchronises a subscriber."""

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.manager.core.pool import Pool
from kvpool.shared.hashing import hash_blocks

BS = 4


def test_take_events_hands_each_event_out_once():
    pool = Pool(16, BS, enable_events=True)
    hashes = hash_blocks(list(range(8)), BS)
    pool.allocate("a", hashes, 8, 8)
    assert pool.take_events() == [BlockStored(hashes, None)]
    assert pool.take_events() == []


def test_a_pool_without_events_queues_none():
    pool = Pool(16, BS)
    pool.allocate("a", hash_blocks(list(range(8)), BS), 8, 8)
    pool.blocks.restate_events()
    assert pool.take_events() == [] and not pool.blocks.events_enabled


def test_restate_replaces_the_queue_with_a_clear_and_the_whole_cache():
    pool = Pool(16, BS, enable_events=True)
    hashes = hash_blocks(list(range(12)), BS)
    pool.allocate("a", hashes, 12, 12)
    pool.free("a")
    pool.evict(1)  # a BlockRemoved queued: the restatement drops it
    pool.blocks.restate_events()
    assert pool.take_events() == [AllBlocksCleared(), BlockStored(list(pool.blocks.cached), None)]
    assert len(pool.blocks.cached) == 2
    empty = Pool(16, BS, enable_events=True)
    empty.blocks.restate_events()
    assert empty.take_events() == [AllBlocksCleared()]


def test_restate_with_a_host_tier_stores_the_host_hashes_after_the_device_ones():
    pool = Pool(6, BS, enable_events=True, host_blocks=8)
    first = hash_blocks(list(range(16)), BS)
    pool.allocate("a", first, 17, 17)  # 5 blocks: the device is full
    pool.free("a")
    pool.end_step()
    other = hash_blocks(list(range(100, 116)), BS)
    pool.allocate("b", other, 17, 17)  # reuses every cached block: first[*] are demoted to the host
    pool.end_step()
    pool.host.reset()  # a host clear queued (as removals): the restatement drops it too
    pool.take_copies()
    for i, h in enumerate(first):
        pool.host.demote(i + 1, h, None)
    pool.end_step()
    pool.restate_events()
    assert pool.take_events() == [AllBlocksCleared(), BlockStored(list(pool.blocks.cached), None),
                                  BlockStored(list(pool.host.blocks.cached), None, "CPU")]
    assert set(pool.host.blocks.cached) == set(first) and set(pool.blocks.cached) == set(other)
    pool.restate_events()  # twice in a row: the same statement, nothing left of the first
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared, BlockStored, BlockStored]
    empty = Pool(6, BS, enable_events=True, host_blocks=8)
    empty.restate_events()
    assert empty.take_events() == [AllBlocksCleared()]


def test_set_events_switches_both_tiers_and_a_restored_pool():
    """The owner's switch: off drops what is queued and queues nothing more, on either tier
    (demotions included), also for a pool a snapshot brought back with events on."""
    from kvpool.manager.core.snapshot import dump_pool, load_pool

    pool = Pool(6, BS, enable_events=True, host_blocks=8)
    first = hash_blocks(list(range(16)), BS)
    pool.allocate("a", first, 17, 17)
    pool.free("a")
    pool.end_step()
    pool.set_events(False)
    assert not pool.events_enabled and pool.take_events() == []
    other = hash_blocks(list(range(100, 116)), BS)
    pool.allocate("b", other, 17, 17)  # demotes first[*] to the host tier
    pool.end_step()
    assert set(pool.host.blocks.cached) == set(first)
    pool.host.reset()
    pool.restate_events()
    assert pool.take_events() == []
    back = load_pool(dump_pool(pool), enable_events=True)  # as the daemon's stores load it
    assert back.events_enabled and back.host.blocks.events_enabled
    back.set_events(False)
    back.free("b")
    back.evict(2)
    back.restate_events()
    assert back.take_events() == [] and not back.host.blocks.events_enabled
    back.set_events(True)  # on again: from an empty queue
    back.evict(1)
    assert [type(e) for e in back.take_events()] == [BlockRemoved]


def test_a_host_tier_added_later_follows_the_pools_switch():
    from kvpool.manager.core.host_tier import HostTier

    pool = Pool(6, BS)
    pool.set_host(HostTier(8, BS, enable_events=True))
    assert not pool.host.blocks.events_enabled


def test_a_device_reset_on_a_pool_with_a_host_tier_states_the_host_tier_again():
    """AllBlocksCleared names no medium (a subscriber drops both tiers): the host tier, which
    a device reset keeps, follows it whole, in place of its own events of that round."""
    pool = Pool(6, BS, enable_events=True, host_blocks=8)
    first = hash_blocks(list(range(16)), BS)
    pool.allocate("a", first, 17, 17)
    pool.free("a")
    pool.end_step()
    pool.allocate("b", hash_blocks(list(range(100, 116)), BS), 17, 17)  # demotes first[*]
    pool.free("b")
    pool.end_step()
    pool.take_events()
    assert pool.reset_prefix_cache("device")
    assert pool.take_events() == [AllBlocksCleared(), BlockStored(list(pool.host.blocks.cached), None, "CPU")]
    assert set(pool.host.blocks.cached) == set(first) and not pool.blocks.cached
    assert pool.reset_prefix_cache("host")
    [removed] = pool.take_events()
    assert type(removed) is BlockRemoved and removed.medium == "CPU" and set(removed.hashes) == set(first)
