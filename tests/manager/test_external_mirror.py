"""The mirror of an external server's cache (manager/external/mirror.py), without sockets:
kvpool's keys from vLLM's events, and every sequencing fault made stale or filled."""

from __future__ import annotations

from kvpool.manager.external.mirror import Mirror
from kvpool.shared.hashing import hash_blocks

BS = 4


def stored(vhashes, tokens, parent=None, medium="GPU", lora=None, extra=None):
    return {"type": "BlockStored", "block_hashes": vhashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": medium, "lora_name": lora, "extra_keys": extra}


def removed(vhashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": vhashes, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}
PROMPT = list(range(100, 112))  # three blocks
H = hash_blocks(PROMPT, BS)


def test_stores_and_removals_key_blocks_by_kvpools_chain_whatever_vllms_hashes_are():
    m = Mirror("v", BS)
    assert m.live(0, [stored([11, 12], PROMPT[:8])]) is None and m.stale is None
    m.live(1, [stored([13], PROMPT[8:], parent=12)])  # a child of a block stored earlier
    assert m.lookup(H) == 3 and m.lookup(hash_blocks(PROMPT, BS, cache_salt="t")) == 0
    m.live(2, [removed([12])])  # the middle block: the prefix stops at it
    assert m.lookup(H) == 1 and m.num_blocks() == 2
    m.live(3, [stored([21], PROMPT[:4], medium="CPU")])  # another tier, kept apart
    assert m.lookup(H, "CPU") == 1 and m.lookup(H) == 1
    m.live(4, [CLEARED])
    assert m.lookup(H) == 0 and m.num_blocks() == 0 and m.stale is None


def test_salt_and_lora_from_vllms_extra_keys_give_kvpools_tenant_keys():
    m = Mirror("v", BS)
    # vLLM's order: the LoRA name (when lora_name is set), then the cache salt (first block only)
    m.live(0, [stored([1, 2], PROMPT[:8], lora="ad", extra=[("ad", "tenant-a"), ("ad",)])])
    assert m.lookup(hash_blocks(PROMPT[:8], BS, cache_salt="tenant-a", lora="ad")) == 2
    assert m.lookup(hash_blocks(PROMPT[:8], BS, lora="ad")) == 0  # another tenant never shares credit
    m.live(1, [stored([3], PROMPT[:4], extra=[(b"embeds-digest",)])])  # prompt embeddings: not keyable
    assert m.stats.orphans == 1


def test_an_orphan_chain_is_counted_not_guessed():
    m = Mirror("v", BS)
    m.live(0, [stored([5], PROMPT[4:8], parent=999)])
    assert m.stats.orphans == 1 and m.num_blocks() == 0


def test_a_gap_asks_for_a_replay_and_holds_live_batches_until_it_ends():
    m = Mirror("v", BS)
    m.live(0, [stored([11], PROMPT[:4])])
    assert m.live(3, [stored([13], PROMPT[8:], parent=12)]) == 1  # 1 and 2 missed
    assert m.live(4, [removed([11])]) is None  # held
    m.replayed(1, [stored([12], PROMPT[4:8], parent=11)])
    m.replayed(2, [])
    m.replayed(3, [stored([13], PROMPT[8:], parent=12)])  # a batch the live side holds too
    m.replay_done()
    assert m.stale is None and m.next_seq == 5 and m.stats.gaps == 1
    assert m.lookup(H) == 0 and m.lookup(H[1:]) == 2  # block 11 removed by the held batch 4


def test_a_gap_the_replay_cannot_fill_makes_the_mirror_stale_until_a_clear():
    m = Mirror("v", BS)
    m.live(0, [stored([11], PROMPT[:4])])
    assert m.live(5, []) == 1
    m.replayed(4, [])  # the buffer starts at 4: 1..3 are gone
    m.replay_done()
    assert m.stale is not None and "1..3" in m.stale and m.stats.lost == 3
    assert m.lookup(H) == 0  # no claim while stale
    m.live(6, [CLEARED, stored([11], PROMPT[:4])])
    assert m.stale is None and m.lookup(H) == 1


def test_a_restarted_publisher_empties_the_mirror_and_a_first_batch_not_zero_is_replayed():
    m = Mirror("v", BS)
    m.live(0, [stored([11, 12], PROMPT[:8])])
    m.live(1, [])
    m.live(0, [])  # the sequence went back: a new server process, an empty cache
    assert m.num_blocks() == 0 and m.stale is None and m.stats.restarts == 1
    late = Mirror("v", BS)
    assert late.live(7, []) == 0  # attached to a server that published before: from its start
    late.replayed(0, [stored([11], PROMPT[:4])])
    for seq in range(1, 7):
        late.replayed(seq, [])
    late.replay_done()
    assert late.stale is None and late.lookup(H) == 1 and late.next_seq == 8


def test_a_replay_that_never_reaches_sequence_zero_leaves_it_stale():
    m = Mirror("v", BS)
    assert m.live(9, []) == 0
    m.replay_done()  # nothing came back (no buffer, or the replay timed out)
    assert m.stale is not None and m.next_seq == 10 and m.lookup(H) == 0


def test_servers_in_the_config_are_attached_at_start_and_bad_entries_refused(sock_dir):
    import pytest

    from kvpool.manager.config import ManagerConfig
    from kvpool.manager.server import Server

    entry = {"name": "v0", "url": "http://127.0.0.1:8000", "model": "m", "block_size": 32, "topic": "v0",
             "replay": "tcp://127.0.0.1:5571"}
    for bad, msg in [({**entry, "block_size": "x"}, "block_size"), ({**entry, "url": "ftp://x"}, "url"), ("v0", "table")]:
        with pytest.raises(ValueError, match=msg):
            ManagerConfig(endpoint=f"ipc://{sock_dir}/m.sock", attach=[bad])
    srv = Server(ManagerConfig(endpoint=f"ipc://{sock_dir}/m.sock", attach=[entry]))
    srv.bind()
    try:
        (row,) = srv.handlers.external_rows()
        assert (row["name"], row["url"], row["stale"]) == ("v0", "http://127.0.0.1:8000", "not subscribed yet") or \
            row["stale"] == "no events received yet"
    finally:
        srv.close()


def test_a_silenced_mirror_claims_nothing_and_rebuilds_from_sequence_0_when_batches_come_again():
    m = Mirror("v", BS)
    m.live(0, [stored([11, 12], PROMPT[:8])])
    m.live(1, [stored([13], PROMPT[8:], parent=12)])
    m.silenced("its KV events stopped")
    assert m.stale == "its KV events stopped" and m.lookup(H) == 0 and m.stats.silenced == 1
    # the next batch (contiguous or not) starts the rebuild: emptied, replayed from 0
    assert m.live(5, [removed([13])]) == 0 and m.stats.rebuilds == 1 and m.num_blocks() == 0
    assert m.lookup(H) == 0
    m.replayed(0, [stored([11, 12], PROMPT[:8])])
    for seq, evs in [(1, [stored([13], PROMPT[8:], parent=12)]), (2, []), (3, []), (4, [removed([12])])]:
        m.replayed(seq, evs)
    m.replay_done()  # then the held batch 5
    assert m.stale is None and m.lookup(H) == 1 and m.num_blocks() == 1 and not m.rebuild


def test_a_rebuild_whose_batch_0_is_gone_stays_stale_and_says_why():
    m = Mirror("v", BS)
    m.live(0, [stored([11], PROMPT[:4])])
    m.silenced("its KV events stopped")
    assert m.live(9, []) == 0
    m.replayed(4, [])  # the buffer starts at 4
    m.replay_done()
    assert m.stale is not None and "lost" in m.stale and m.lookup(H) == 0
    m.live(10, [CLEARED])  # a clean state again: exact
    assert m.stale is None


def test_the_cpu_tier_continues_the_device_tiers_prefix():
    m = Mirror("v", BS)
    m.live(0, [stored([11], PROMPT[:4]), stored([21, 22, 23], PROMPT, medium="CPU")])
    assert m.lookup_tiers(H) == (1, 2)  # block 0 on the device, 1 and 2 loadable from the CPU tier
    m.live(1, [removed([22], medium="CPU")])
    assert m.lookup_tiers(H) == (1, 0)  # the CPU tier's own prefix now stops after block 0
    m.silenced("stopped")
    assert m.lookup_tiers(H) == (0, 0)
