"""The layout translation (kvpool/integrations/vllm/kv_layout.py) against vLLM's own indexing:
K and V written the way vLLM 0.32.0's CPU backend (``CPU_ATTN``) and 0.33.0's GPU backends
(``FLASH_ATTN`` and the others: ``transpose(1, 2).split``) address them, in their physical
layouts, read back as node-tier blocks ``[layers, 2, block_size, heads, head_size]``; a block
gathered from one layout and scattered into the other reads as the same K and V there."""

from __future__ import annotations

import pytest
import torch

from kvpool.integrations.vllm.kv_layout import block_view, gather, scatter

NB, H, N, D = 7, 3, 32, 16  # blocks, kv heads, block size, head size (odd head count on purpose)


def cpu_cache() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CPU_ATTN layer ``[NB, H, N, 2D]`` and its K, V ``[NB, H, N, D]`` as the backend views them
    (vllm/v1/attention/backends/cpu_attn.py: ``view(nb, heads, 2 * bs, -1).chunk(2, dim=2)``)."""
    cache = torch.zeros(NB, H, N, 2 * D)
    key_cache, value_cache = cache.view(NB, H, 2 * N, D).chunk(2, dim=2)
    key_cache.copy_(torch.randn(NB, H, N, D))
    value_cache.copy_(torch.randn(NB, H, N, D))
    return cache, key_cache, value_cache


def gpu_cache(physical: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 0.33.0 GPU layer, logical ``[NB, H, N, 2D]`` over ``physical`` memory order (``LBHNC``:
    as logical; ``LBNHC``: tokens outside heads, FlashAttention's NHD), and its K, V as
    flash_attn.py views them: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` ([NB, N, H, D])."""
    if physical == "LBNHC":
        cache = torch.zeros(NB, N, H, 2 * D).permute(0, 2, 1, 3)
    else:
        cache = torch.zeros(NB, H, N, 2 * D)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    key_cache.copy_(torch.randn(NB, N, H, D))
    value_cache.copy_(torch.randn(NB, N, H, D))
    return cache, key_cache.transpose(1, 2), value_cache.transpose(1, 2)  # K, V as [NB, H, N, D]


@pytest.mark.parametrize("kind,physical", [("cpu", "LBHNC"), ("split", "LBHNC"), ("split", "LBNHC")])
def test_a_view_reads_k_and_v_as_the_backend_wrote_them(kind, physical):
    cache, k, v = cpu_cache() if kind == "cpu" else gpu_cache(physical)
    view = block_view(cache, kind, N, H, D)
    assert view.shape == (NB, 2, N, H, D)
    torch.testing.assert_close(view[:, 0], k.transpose(1, 2), rtol=0, atol=0)  # [NB, N, H, D]
    torch.testing.assert_close(view[:, 1], v.transpose(1, 2), rtol=0, atol=0)
    view[3, 1, 5, 2] = 42.0  # a view of vLLM's memory: a write lands in its V
    assert v[3, 2, 5].eq(42.0).all()


def test_a_block_moves_between_the_cpu_and_the_gpu_layouts_unchanged():
    layers_src = [cpu_cache() for _ in range(2)]
    layers_dst = [gpu_cache("LBNHC") for _ in range(2)]
    src = [block_view(c, "cpu", N, H, D) for c, _, _ in layers_src]
    dst = [block_view(c, "split", N, H, D) for c, _, _ in layers_dst]
    before = [k.clone() for _, k, _ in layers_dst]
    blocks = gather(src, [5, 2])
    assert blocks.shape == (2, 2, 2, N, H, D) and blocks.is_contiguous()  # [n, layers, 2, N, H, D]
    scatter(dst, [1, 6], list(blocks))
    for (_, k_src, v_src), (_, k_dst, v_dst), k_before in zip(layers_src, layers_dst, before):
        for s, d in ((5, 1), (2, 6)):
            torch.testing.assert_close(k_dst[d], k_src[s], rtol=0, atol=0)
            torch.testing.assert_close(v_dst[d], v_src[s], rtol=0, atol=0)
        untouched = [b for b in range(NB) if b not in (1, 6)]
        torch.testing.assert_close(k_dst[untouched], k_before[untouched], rtol=0, atol=0)


def test_a_layer_of_another_shape_is_refused_by_what_it_needs():
    with pytest.raises(ValueError, match="kernel block size"):
        block_view(torch.zeros(NB, H, 16, 2 * D), "cpu", N, H, D)
    with pytest.raises(ValueError, match="contiguous within a block"):
        block_view(torch.zeros(NB, N, H, 2 * D).permute(0, 2, 1, 3), "cpu", N, H, D)
    with pytest.raises(ValueError, match="unknown vLLM KV layout"):
        block_view(torch.zeros(NB, H, N, 2 * D), "mla", N, H, D)
