"""reshape_and_cache and copy_blocks: Triton kernels against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_factories import DEVICE, gpu, requires_cuda

from kvpool.kernels import AttentionInputError
from kvpool.kernels.copy_blocks_triton import copy_blocks
from kvpool.kernels.reference import copy_blocks_ref, reshape_and_cache_ref
from kvpool.kernels.reshape_and_cache_triton import reshape_and_cache


def _random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def _check_reshape_and_cache(num_kv_heads, head_size, block_size, dtype):
    num_tokens, num_blocks = 21, 6
    g = torch.Generator().manual_seed(1)
    # K and V as slices of one fused projection output: token stride != heads * head_size.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_size, generator=g).to(DEVICE, dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 7, 20]] = -1
    slots = slots.to(DEVICE)
    cache = _random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)  # a pure copy: bit exact, untouched slots included
    written = slots[slots >= 0]
    blocks, offsets = written // block_size, written % block_size
    assert torch.equal(cache[0, blocks, offsets], key[slots >= 0])


@pytest.mark.parametrize(
    "num_kv_heads,head_size,block_size,dtype",
    [
        (1, 64, 16, torch.float32),
        (2, 80, 32, torch.float16),
        (3, 128, 16, torch.float16),
        (2, 96, 16, torch.float32),
    ],
)
def test_reshape_and_cache_matches_reference(num_kv_heads, head_size, block_size, dtype):
    _check_reshape_and_cache(num_kv_heads, head_size, block_size, dtype)


def test_reshape_and_cache_all_skipped_changes_nothing():
    cache = _random_cache(3, 16, 1, 64, torch.float32)
    before = cache.clone()
    key = torch.randn(4, 1, 64, device=DEVICE)
    reshape_and_cache(key, key, cache, torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("write", [reshape_and_cache, reshape_and_cache_ref], ids=["triton", "torch"])
def test_reshape_and_cache_rejects_int32_slots(write):
    cache = _random_cache(3, 16, 1, 64, torch.float32)
    key = torch.randn(2, 1, 64, device=DEVICE)
    with pytest.raises(AttentionInputError, match="slot_mapping must be int64"):
        write(key, key, cache, torch.zeros(2, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("write", [reshape_and_cache, reshape_and_cache_ref], ids=["triton", "torch"])
def test_reshape_and_cache_refuses_a_key_of_another_dtype(write):
    # The reference used to cast an fp32 key into an fp16 cache silently; Triton refused it.
    cache = _random_cache(3, 16, 1, 64, torch.float16)
    before = cache.clone()
    key = torch.randn(2, 1, 64, device=DEVICE)
    with pytest.raises(AttentionInputError, match="cast key and value to the cache dtype"):
        write(key, key, cache, torch.tensor([1, 2], device=DEVICE))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_size,dtype",
    [(16, 1, 80, torch.float16), (32, 2, 64, torch.float32)],
)
def test_copy_blocks_matches_reference(block_size, num_kv_heads, head_size, dtype):
    caches = [
        _random_cache(7, block_size, num_kv_heads, head_size, dtype, seed=s) for s in range(3)
    ]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([[2, 5], [1, 6], [2, 3]], dtype=torch.int64, device=DEVICE)
    copy_blocks_ref(expected, mapping)
    copy_blocks(caches, mapping)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(caches[1][:, 5], caches[1][:, 2]) and torch.equal(caches[2][1, 3], caches[2][1, 2])


def test_copy_blocks_empty_mapping_is_a_no_op():
    caches = [_random_cache(3, 16, 1, 64, torch.float32)]
    before = caches[0].clone()
    copy_blocks(caches, torch.zeros(0, 2, dtype=torch.int64, device=DEVICE))
    assert torch.equal(caches[0], before)


@gpu
@requires_cuda
def test_cache_ops_bf16_on_gpu():
    _check_reshape_and_cache(2, 128, 16, torch.bfloat16)
    caches = [_random_cache(5, 16, 2, 128, torch.bfloat16, seed=s) for s in range(2)]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 4]], device=DEVICE)
    copy_blocks_ref(expected, mapping)
    copy_blocks(caches, mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))


@pytest.mark.parametrize("copy", [copy_blocks, copy_blocks_ref], ids=["triton", "torch"])
@pytest.mark.parametrize(
    "mapping,message",
    [
        (torch.tensor([[1, 2]], dtype=torch.int32), "block_mapping must be int64"),
        (torch.tensor([[1, 2], [2, 3]]), "must not be sources of the same call"),
        (torch.tensor([[1, 9]]), r"block_mapping names blocks outside \[0, 7\)"),
    ],
)
def test_both_copy_paths_refuse_the_same_mappings(copy, mapping, message):
    # The reference used to take int32 and chained copies that the concurrent kernel cannot order.
    caches = [_random_cache(7, 16, 1, 64, torch.float32)]
    before = caches[0].clone()
    with pytest.raises(AttentionInputError, match=message):
        copy(caches, mapping)
    assert torch.equal(caches[0], before)
