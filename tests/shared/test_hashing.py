"""Chained block hashing against PROTOCOL.md's vectors and an independent re-implementation."""

import hashlib
import struct

import pytest

from kvpool.shared.hashing import (
    SEED,
    BlockHasher,
    MMInput,
    extra_keys,
    hash_blocks,
    tokens_to_bytes,
)


def naive_chain(tokens, bs, extras=None):
    """Re-implements PROTOCOL.md section 1 with struct only."""
    parent = hashlib.sha256(b"kvpool/block-hash/v1").digest()
    out = []
    for i in range(len(tokens) // bs):
        extra = (extras or {}).get(i, b"")
        data = parent + struct.pack("<I", len(extra)) + extra
        data += b"".join(struct.pack("<I", t) for t in tokens[i * bs : (i + 1) * bs])
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def test_seed_and_vectors():
    assert SEED.hex() == "25777830d548ba236decb5496dcfe790c11b5ee3a3c332a36c5c1aada1f0f669"
    h = hash_blocks(list(range(32)), 16)
    assert [x.hex() for x in h] == [
        "141e74053ed9be2e5aa5a0c5a5e68e5855c7f487dca83da79a918a12209d7995",
        "5f5dadf4e35be01959b5ac26eb40a03375ad956deed6f02976b4518598562079",
    ]
    salted = hash_blocks(list(range(32)), 16, cache_salt="tenant-a")
    assert salted[0].hex() == "0c87f63e5001cc565d0d35b83c4bcdc3e52d888c46cd70d9f979667823c65b1f"
    assert salted[1].hex() == "c04c6eaf17498c2c074abd4d81f80ae1b32e1087a092cd0056abf26748199c90"
    lm = hash_blocks(list(range(16)), 16, lora="sql-lora", mm_inputs=[MMInput("img-0", 4, 8)])
    assert lm[0].hex() == "59e3c49b8399c990053107d333ead4d9171f0912bed0baf4ed5010a3f72f2e47"
    assert tokens_to_bytes([1, 2, 70000]).hex() == "010000000200000070110100"


def test_matches_independent_implementation():
    tokens = [(i * 7919) % 50021 for i in range(100)]
    assert hash_blocks(tokens, 8) == naive_chain(tokens, 8)
    salt = extra_keys(0, 8, cache_salt="t")
    assert salt == b"\x01\x01\x00\x00\x00t"
    assert hash_blocks(tokens, 8, cache_salt="t") == naive_chain(tokens, 8, {0: salt})


def test_partial_block_not_hashed_and_chain_depends_on_parent():
    assert hash_blocks(list(range(15)), 16) == []
    a = hash_blocks([1] * 16 + [2] * 16, 16)
    b = hash_blocks([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1], "same tokens after a different parent must hash differently"


def test_salt_only_in_block_zero_but_changes_whole_chain():
    assert extra_keys(1, 16, cache_salt="x") == b""
    plain = hash_blocks(list(range(48)), 16)
    salted = hash_blocks(list(range(48)), 16, cache_salt="x")
    assert all(p != s for p, s in zip(plain, salted))


def test_multimodal_overlap():
    mm = [MMInput("img", 20, 4)]
    assert extra_keys(0, 16, mm_inputs=mm) == b""
    assert extra_keys(1, 16, mm_inputs=mm) == b"\x03\x07\x00\x00\x00" + struct.pack("<i", 4) + b"img"
    assert extra_keys(2, 16, mm_inputs=mm) == b""


def test_multimodal_key_carries_the_items_offset_within_the_block():
    """As vLLM 0.33's ("mm", identifier, offset - block start): the same item at another place in
    otherwise identical placeholder blocks is another key; an item begun in an earlier block is < 0."""
    long = [MMInput("img", 20, 30)]
    assert extra_keys(2, 16, mm_inputs=long) == b"\x03\x07\x00\x00\x00" + struct.pack("<i", -12) + b"img"
    pad = [7] * 48  # placeholder tokens only
    at20 = hash_blocks(pad, 16, mm_inputs=[MMInput("img", 20, 28)])
    at22 = hash_blocks(pad, 16, mm_inputs=[MMInput("img", 22, 26)])
    assert at20[0] == at22[0] and at20[1] != at22[1] and at20[2] != at22[2]
    extras = {1: extra_keys(1, 16, mm_inputs=[MMInput("img", 20, 28)]),
              2: extra_keys(2, 16, mm_inputs=[MMInput("img", 20, 28)])}
    assert at20 == naive_chain(pad, 16, extras)


def test_incremental_hasher_equals_one_shot():
    tokens = list(range(1000, 1000 + 70))
    hasher = BlockHasher(16, cache_salt="s", lora="l")
    got = []
    for chunk in (tokens[:5], tokens[5:33], tokens[33:34], tokens[34:]):
        got += hasher.append(chunk)
    expected = hash_blocks(tokens, 16, cache_salt="s", lora="l")
    assert got == expected == hasher.hashes
    assert len(expected) == 4


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_out_of_range_tokens_rejected(bad):
    with pytest.raises(OverflowError):
        tokens_to_bytes(bad)


@pytest.mark.parametrize("container", [list, tuple, iter])
@pytest.mark.parametrize("bad", [[5, -1], [5, 2**32]])
def test_out_of_range_tokens_rejected_from_any_container(container, bad):
    """A list takes a faster conversion than other sequences: both refuse the same ids."""
    with pytest.raises(OverflowError):
        tokens_to_bytes(container(bad))
    with pytest.raises(OverflowError):
        hash_blocks(container(bad * 8), 16)


def test_list_tuple_and_independent_implementation_agree_on_long_prompts():
    tokens = [(i * 104729) % 2**32 for i in range(16 * 40 + 7)]
    assert tokens_to_bytes(tokens) == tokens_to_bytes(tuple(tokens)) == struct.pack(f"<{len(tokens)}I", *tokens)
    assert hash_blocks(tokens, 16) == hash_blocks(tuple(tokens), 16) == naive_chain(tokens, 16)
