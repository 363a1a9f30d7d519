"""Plain-torch truth for every kernel op; also the worker's CPU execution path.

Shapes (per layer): kv_cache [2, num_blocks, block_size, num_kv_heads, head_size] (0 = K, 1 = V);
the batch is described by an ``AttentionMetadata`` (metadata.py). Inputs are checked by the same
functions as the Triton path (``check_attention``, ``check_cache_write``), so both accept and
refuse the same inputs.

Attention is computed in fp32 and returned in the query dtype. Decode sequences (q_len 1) are
batched together with padding, longer queries done one sequence at a time; both in chunks (of
sequences, of queries) so the fp32 temporaries stay bounded. What every layer of a step shares
(the split into decode chunks and prefills, block lists, masks) is planned once per step and kept
on the metadata; K/V are gathered block-wise and read by SDPA as strided views, not copied twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checks import check_attention, check_cache_write, check_copy_blocks
from .metadata import AttentionMetadata

# Bound on the fp32 temporaries (gathered K/V, scores) of one query chunk (~256 MiB).
_MAX_TEMP_ELEMS = 1 << 26


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # key, value: [num_tokens, num_kv_heads, head_size]
    check_cache_write(key, value, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if kv_cache.device.type == "cpu" and bool(valid.all()):  # the usual step: no skipped slots
        slots = slot_mapping
    else:
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key
    kv_cache[1, blocks, offsets] = value


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * r / rms(r), r) with r = x + residual (or x): Llama's RMSNorm, fp32 inside."""
    r = x if residual is None else residual + x
    rf = r.float()
    return weight * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype), r


def rope_ref(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_size] by each token's cos/sin rows c, s
    [tokens, 1, head_size / 2] (fp32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def copy_blocks_ref(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    # block_mapping: [n, 2] of (src, dst); every source is read before any destination is written.
    check_copy_blocks(kv_caches, block_mapping)
    src = block_mapping[:, 0].to(torch.long)
    dst = block_mapping[:, 1].to(torch.long)
    for kv_cache in kv_caches:
        kv_cache[:, dst.to(kv_cache.device)] = kv_cache[:, src.to(kv_cache.device)]


def _gather_kv(
    kv_cache: torch.Tensor, blocks: torch.Tensor, batch: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # blocks: [batch * num_blocks] long -> k, v: [batch, kv_heads, num_blocks * block_size, head]
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    # index_select copies whole blocks; advanced indexing (kv_cache[:, blocks]) is ~5x slower.
    kv = kv_cache.index_select(1, blocks)
    kv = kv.view(2, batch, num_blocks * block_size, num_kv_heads, head_size)
    # A strided view, not a copy: SDPA's CPU kernel reads K/V by their strides. A .contiguous()
    # here (a second copy of every context's K/V, per layer) made CPU decode attention 2.3x
    # slower (3.0 against 1.3 ms a layer at batch 8, context 320, one thread).
    kv = kv.float().transpose(2, 3)
    return kv[0], kv[1]


def _mask(q_pos: torch.Tensor, kv_len: torch.Tensor, kv: int, group: int, sliding_window: int | None) -> torch.Tensor:
    """[batch, 1, group * m, kv] bool: key position p is visible to the query at q_pos when
    p <= q_pos, p < kv_len (padding) and, with a window, p > q_pos - window."""
    batch, m = q_pos.shape
    k_pos = torch.arange(kv, device=q_pos.device)
    allowed = (k_pos <= q_pos[:, :, None]) & (k_pos < kv_len[:, None, None])  # [batch, m, kv]
    if sliding_window is not None:
        allowed &= k_pos > q_pos[:, :, None] - sliding_window
    return allowed[:, None].expand(batch, group, m, -1).reshape(batch, 1, group * m, -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Masked attention of queries over a padded K/V (``allowed`` from _mask).

    q: [batch, m, num_heads, head] fp32; k, v: [batch, num_kv_heads, kv, head] fp32 (strided
    views are fine). Returns [batch, m, num_heads, head]. The query heads of a kv head's group
    are folded into the query length (rows (g, m)), so GQA needs neither repeated K/V nor
    enable_gqa.
    """
    batch, m, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.view(batch, m, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    qf = qf.reshape(batch, num_kv_heads, group * m, head_size)
    if softcap is None:
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=allowed, scale=scale)
    else:
        scores = softcap * torch.tanh(qf @ k.transpose(-1, -2) * (scale / softcap))
        o = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    o = o.view(batch, num_kv_heads, group, m, head_size).permute(0, 3, 1, 2, 4)
    return o.reshape(batch, m, num_heads, head_size)


@dataclass(frozen=True)
class _DecodeChunk:
    tokens: torch.Tensor  # [n] long: the query row of each decode sequence of the chunk
    blocks: torch.Tensor  # [n * num_blocks] long: their block tables, padding as the null block
    num_blocks: int
    allowed: torch.Tensor  # [n, 1, group, num_blocks * block_size] bool


@dataclass(frozen=True)
class _Plan:
    """What every layer of a step shares: the batch split into decode chunks and prefills, with
    block lists and masks. Built once per (metadata, cache shape, heads, window); the layers of
    a step then only gather, attend and write."""

    decode: list[_DecodeChunk]
    prefill: list[tuple[int, int, int, torch.Tensor]]  # (start, q_len, seq_len, table row)


def _plan(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> _Plan:
    block_size, (num_kv_heads, head_size) = kv_cache.shape[2], kv_cache.shape[3:]
    num_heads = query.shape[1]
    key = (block_size, num_heads, num_kv_heads, head_size, meta.sliding_window, str(query.device))
    return meta.derived(key, lambda: _build_plan(query, block_size, num_kv_heads, head_size, meta))


def _build_plan(query: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int,
                meta: AttentionMetadata) -> _Plan:
    num_heads = query.shape[1]
    qsl, seq_lens = meta.query_start_loc, meta.seq_lens
    block_table = _without_padding(meta.block_tables, seq_lens, block_size)
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    starts, lens = qsl[:-1].tolist(), seq_lens.tolist()
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    chunks = []
    if decode:
        # Per decode row: its padded K and V plus one score per query head and position.
        per_row = max(lens[s] for s in decode) * (2 * num_kv_heads * head_size + num_heads)
        step = max(1, _MAX_TEMP_ELEMS // per_row)
        for i in range(0, len(decode), step):
            rows = decode[i : i + step]
            idx = torch.tensor(rows, device=query.device)
            n_blocks = -(-max(lens[s] for s in rows) // block_size)
            kv_len = seq_lens[idx].to(torch.long)
            allowed = _mask((kv_len - 1)[:, None], kv_len, n_blocks * block_size, num_heads // num_kv_heads,
                            meta.sliding_window)
            chunks.append(_DecodeChunk(qsl[idx].to(torch.long), block_table[idx, :n_blocks].flatten().to(torch.long),
                                       n_blocks, allowed))
    prefill = [(starts[s], n, lens[s], block_table[s]) for s, n in enumerate(q_lens) if n > 1]
    return _Plan(chunks, prefill)


def _decode_chunk(query: torch.Tensor, kv_cache: torch.Tensor, c: _DecodeChunk, scale: float,
                  softcap: float | None) -> torch.Tensor:
    # Every sequence of the chunk has q_len 1; returns [n, num_heads, head] fp32.
    k, v = _gather_kv(kv_cache, c.blocks, c.tokens.shape[0], c.num_blocks)
    q = query.index_select(0, c.tokens).float().unsqueeze(1)  # [n, 1, num_heads, head]
    return _attend(q, k, v, c.allowed, scale, softcap).squeeze(1)


def _prefill_one(query, kv_cache, seq_len, q_start, q_len, table_row, scale, window, softcap):
    # One sequence's query of q_len tokens; returns [q_len, num_heads, head] fp32.
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    k, v = _gather_kv(kv_cache, table_row[:num_blocks].to(torch.long), 1, num_blocks)
    num_heads, group = query.shape[1], query.shape[1] // kv_cache.shape[3]
    chunk = max(1, _MAX_TEMP_ELEMS // (num_heads * k.shape[2]))
    kv_len = torch.tensor([seq_len], device=query.device)
    outs = []
    for c0 in range(0, q_len, chunk):
        c1 = min(q_len, c0 + chunk)
        q = query[q_start + c0 : q_start + c1].float()[None]
        q_pos = torch.arange(seq_len - q_len + c0, seq_len - q_len + c1, device=query.device)
        allowed = _mask(q_pos[None], kv_len, k.shape[2], group, window)
        outs.append(_attend(q, k, v, allowed, scale, softcap)[0])
    return torch.cat(outs)


def prefill_into(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seq: int,
                 out: torch.Tensor) -> None:
    """Sequence ``seq``'s queries, any length, by one gather and SDPA, written into ``out`` (the
    CPU op's path for long queries, kernels/paged_attention_cpu.py; inputs checked there)."""
    start, end = int(meta.query_start_loc[seq]), int(meta.query_start_loc[seq + 1])
    res = _prefill_one(query, kv_cache, int(meta.seq_lens[seq]), start, end - start, meta.block_tables[seq],
                       meta.scale, meta.sliding_window, meta.softcap)
    out[start:end] = res.to(out.dtype)


def _without_padding(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    # Entries past a sequence's own blocks are padding (0, -1, anything): the Triton kernels
    # never read them; here they become the null block, whose positions the mask hides.
    needed = (seq_lens.to(torch.long) + block_size - 1) // block_size
    used = torch.arange(block_table.shape[1], device=block_table.device) < needed[:, None]
    return torch.where(used, block_table, 0)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # query: [num_tokens, num_heads, head_size] -> [num_tokens, num_heads, head_size]
    if out is None:
        out = torch.empty_like(query)
    check_attention(query, kv_cache, meta, out)
    plan = _plan(query, kv_cache, meta)
    for c in plan.decode:
        res = _decode_chunk(query, kv_cache, c, meta.scale, meta.softcap)
        out.index_copy_(0, c.tokens, res.to(out.dtype))
    for start, n, seq_len, row in plan.prefill:
        res = _prefill_one(query, kv_cache, seq_len, start, n, row, meta.scale, meta.sliding_window, meta.softcap)
        out[start : start + n] = res.to(out.dtype)
    return out
