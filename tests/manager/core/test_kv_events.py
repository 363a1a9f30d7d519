"""KV events leave a pool once, through take_events; restate_events resynchronises a subscriber."""

from kvpool.manager.core.kv_events import AllBlocksCleared, BlockStored
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
