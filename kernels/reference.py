"""Plain-torch truth for every kernel op; also the worker's CPU execution path.

Shapes (per layer):
    kv_cache:        [2, num_blocks, block_size, num_kv_heads, head_size]  (0 = K, 1 = V)
    slot_mapping:    [num_tokens] int64, slot = block_id * block_size + offset, -1 = skip
    query_start_loc: [num_seqs + 1] int32 prefix sums of query lengths
    seq_lens:        [num_seqs] int32, context length including the new tokens
    block_table:     [num_seqs, max_blocks] int32, padded with the null block 0

Attention is computed in fp32 and returned in the query dtype. Decode sequences (q_len 1) are
batched together with padding; longer queries are done one sequence at a time, in query chunks
so the fp32 score matrix stays bounded.
"""

from __future__ import annotations

import torch

# Bound on the fp32 score elements materialised at once by a prefill chunk (~256 MiB).
_MAX_SCORE_ELEMS = 1 << 26


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # key, value: [num_tokens, num_kv_heads, head_size]
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[valid].to(kv_cache.dtype)


def copy_blocks_ref(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    # block_mapping: [n, 2] of (src, dst); every source is read before any destination is written.
    src = block_mapping[:, 0].to(torch.long)
    dst = block_mapping[:, 1].to(torch.long)
    for kv_cache in kv_caches:
        kv_cache[:, dst.to(kv_cache.device)] = kv_cache[:, src.to(kv_cache.device)]


def _gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # block_table: [batch, >= num_blocks] -> k, v: [batch, num_blocks * block_size, kv_heads, head]
    blocks = block_table[:, :num_blocks].to(torch.long)
    kv = kv_cache[:, blocks]  # [2, batch, num_blocks, block_size, kv_heads, head]
    kv = kv.flatten(2, 3).float()
    return kv[0], kv[1]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Masked attention of absolute-positioned queries over a padded contiguous K/V.

    q: [batch, m, num_heads, head] fp32; k, v: [batch, kv, num_kv_heads, head] fp32;
    q_pos: [batch, m] absolute positions; kv_len: [batch]. Returns [batch, m, num_heads, head].
    """
    batch, m, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(batch, m, num_kv_heads, group, head_size)
    scores = torch.einsum("bmhgd,blhd->bhgml", qg, k) * scale  # [batch, kvh, group, m, kv]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[1], device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < kv_len[:, None, None]
    )
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgml,blhd->bmhgd", probs, v)
    return out.reshape(batch, m, num_heads, head_size)


def _decode_batch(query, kv_cache, seq_lens, block_table, rows, tokens, scale, window, softcap):
    # All sequences in `rows` have q_len 1; token i of `tokens` belongs to row i.
    block_size = kv_cache.shape[2]
    lens = seq_lens[rows].to(torch.long)
    num_blocks = -(-int(lens.max()) // block_size)
    k, v = _gather_kv(kv_cache, block_table[rows], num_blocks)
    q = query[tokens].float().unsqueeze(1)  # [n, 1, num_heads, head]
    out = _attend(q, k, v, (lens - 1)[:, None], lens, scale, window, softcap)
    return out.squeeze(1)


def _prefill_one(query, kv_cache, seq_len, q_start, q_len, table_row, scale, window, softcap):
    # One sequence's query of q_len tokens; returns [q_len, num_heads, head] fp32.
    block_size = kv_cache.shape[2]
    k, v = _gather_kv(kv_cache, table_row[None], -(-seq_len // block_size))
    num_heads = query.shape[1]
    chunk = max(1, _MAX_SCORE_ELEMS // (num_heads * k.shape[1]))
    kv_len = torch.tensor([seq_len], device=query.device)
    outs = []
    for c0 in range(0, q_len, chunk):
        c1 = min(q_len, c0 + chunk)
        q = query[q_start + c0 : q_start + c1].float()[None]
        q_pos = torch.arange(seq_len - q_len + c0, seq_len - q_len + c1, device=query.device)
        outs.append(_attend(q, k, v, q_pos[None], kv_len, scale, window, softcap)[0])
    return torch.cat(outs)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # query: [num_tokens, num_heads, head_size] -> [num_tokens, num_heads, head_size]
    if out is None:
        out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor(decode, device=query.device)
        tokens = query_start_loc[:-1].to(torch.long)[rows]
        res = _decode_batch(
            query, kv_cache, seq_lens, block_table, rows, tokens, scale, sliding_window, softcap
        )
        out[tokens] = res.to(out.dtype)
    seq_len_list = seq_lens.tolist()
    for s, n in enumerate(q_lens):
        if n <= 1:
            continue
        res = _prefill_one(
            query, kv_cache, seq_len_list[s], starts[s], n, block_table[s], scale,
            sliding_window, softcap,
        )
        out[starts[s] : starts[s] + n] = res.to(out.dtype)
    return out
