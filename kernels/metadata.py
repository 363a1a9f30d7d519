"""The attention metadata of one batch, and the one check every attention path runs.

``AttentionMetadata`` is built once per step (``from_lengths``) and handed to the dispatcher, the
Triton launch wrappers and the torch reference alike; ``check_attention`` is the single place that
decides which inputs are accepted, so the CPU path and the Triton path accept and refuse the same
ones. No triton import here: the reference must work where triton is missing.

Shapes (per batch of num_seqs sequences and num_tokens new tokens):
    query_start_loc: [num_seqs + 1] int32, prefix sums of the query lengths (a length may be 0)
    seq_lens:        [num_seqs] int32, context length including the new tokens
    block_tables:    [num_seqs, max_blocks] int32; entries past a sequence's last block are
                     padding and never read (0, the null block, or -1)
    slot_mapping:    [num_tokens] int64, block * block_size + offset, -1 = skip (cache writes)

Value checks (lengths, prefix sums, block ids in range) need the tensors' contents: they run when
the tensors are on the CPU and are skipped on CUDA, where reading them would stall the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AttentionInputError(ValueError):
    """Attention inputs that no path accepts; the message says what to change."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise AttentionInputError(message)


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int  # an upper bound of the query lengths (the longest one, ideally)
    max_seq_len: int  # an upper bound of seq_lens
    scale: float
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64
    sliding_window: int | None = None  # None = off; else each query sees its last n positions
    softcap: float | None = None  # None = off; else logits become c * tanh(logits / c)
    # (num_blocks, block_size) of caches whose block ids were checked: once per step, not per layer
    _tables_checked: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.query_start_loc.device.type == "cpu":
            _check_values(self)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def is_decode_only(self, num_tokens: int) -> bool:
        """Every sequence has exactly one new token (so split-KV decode applies).

        Decided from the query lengths: lengths bounded by 1 summing to num_seqs are all 1. A
        batch with empty queries ([2, 0]) has as many tokens as sequences but is not decode.
        """
        return self.max_query_len == 1 and num_tokens == self.num_seqs

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The same metadata with its tensors on ``device`` (copied without a sync)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(
            self, query_start_loc=move(self.query_start_loc), seq_lens=move(self.seq_lens),
            block_tables=move(self.block_tables), slot_mapping=move(self.slot_mapping),
        )

    @classmethod
    def from_lengths(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        scale: float,
        *,
        block_size: int | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from host lists; rows of ``block_tables`` are padded with 0 to one width.

        With ``block_size``, the slot mapping of every new token is built too.
        """
        _need(len(query_lens) == len(seq_lens) == len(block_tables),
              f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
              f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}")
        width = max((len(row) for row in block_tables), default=0)
        table = torch.tensor([row + [0] * (width - len(row)) for row in block_tables],
                             dtype=torch.int32).reshape(len(block_tables), width)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0, out=qsl[1:])
        slots = None if block_size is None else _slots(query_lens, seq_lens, table, block_size)
        meta = cls(
            query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table, max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0), scale=scale, slot_mapping=slots,
            sliding_window=sliding_window, softcap=softcap,
        )
        return meta if torch.device(device).type == "cpu" else meta.to(device)


def _slots(query_lens: list[int], seq_lens: list[int], table: torch.Tensor, block_size: int) -> torch.Tensor:
    # The slot of token j of sequence s: position seq_lens[s] - q_len + j in its block table.
    q = torch.tensor(query_lens, dtype=torch.int64)
    num_tokens = int(q.sum())
    # output_size: without it repeat_interleave syncs its threads (milliseconds on a busy CPU)
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), q, output_size=num_tokens)
    first = torch.tensor(seq_lens, dtype=torch.int64) - q
    starts = torch.cumsum(q, 0) - q
    pos = first[seq] + torch.arange(num_tokens) - starts[seq]
    return table[seq, pos // block_size].to(torch.int64) * block_size + pos % block_size


def _check_fields(m: AttentionMetadata) -> None:
    """Dtypes, shapes, devices and the scalar options: cheap, no reads of tensor contents."""
    num_seqs = m.seq_lens.shape[0] if m.seq_lens.dim() == 1 else -1
    width = m.block_tables.shape[1] if m.block_tables.dim() == 2 else -1
    for name, t, dtype, shape in (
        ("query_start_loc", m.query_start_loc, torch.int32, (num_seqs + 1,)),
        ("seq_lens", m.seq_lens, torch.int32, (num_seqs,)),
        ("block_tables", m.block_tables, torch.int32, (num_seqs, width)),
    ):
        _need(t.dtype == dtype and tuple(t.shape) == shape,
              f"{name} must be {dtype} of shape {shape} (num_seqs {num_seqs}), got "
              f"{t.dtype} {tuple(t.shape)}")
        _need(t.device == m.seq_lens.device, f"{name} is on {t.device}, seq_lens on {m.seq_lens.device}")
    _need(m.query_start_loc.is_contiguous() and m.seq_lens.is_contiguous()
          and (width <= 1 or m.block_tables.stride(1) == 1),
          "query_start_loc, seq_lens and block_tables rows must be contiguous")
    if m.slot_mapping is not None:
        _need(m.slot_mapping.dtype == torch.int64 and m.slot_mapping.dim() == 1,
              f"slot_mapping must be 1-D int64, got {m.slot_mapping.dtype} {tuple(m.slot_mapping.shape)}")
    _need(m.max_query_len >= 0 and m.max_seq_len >= 0,
          f"max_query_len {m.max_query_len} and max_seq_len {m.max_seq_len} must be >= 0")
    _need(m.sliding_window is None or (isinstance(m.sliding_window, int) and m.sliding_window >= 1),
          f"sliding_window must be None (no window) or an int >= 1, got {m.sliding_window!r}")
    _need(m.softcap is None or (math.isfinite(m.softcap) and m.softcap > 0),
          f"softcap must be None (no capping) or a finite number > 0, got {m.softcap!r}")
    _need(math.isfinite(m.scale), f"scale must be finite, got {m.scale!r}")


def _check_values(m: AttentionMetadata) -> None:
    """Prefix sums, length bounds: the contents of CPU tensors."""
    qsl = m.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]
    _need(int(qsl[0]) == 0, f"query_start_loc must start at 0, got {int(qsl[0])}")
    if m.num_seqs == 0:
        return
    _need(bool((q_lens >= 0).all()), f"query_start_loc must not decrease, got {qsl.tolist()}")
    _need(int(q_lens.max()) <= m.max_query_len,
          f"max_query_len {m.max_query_len} is below the longest query ({int(q_lens.max())})")
    _need(bool((q_lens <= m.seq_lens).all()),
          f"a query is longer than its sequence: query lengths {q_lens.tolist()}, "
          f"seq_lens {m.seq_lens.tolist()}")
    _need(int(m.seq_lens.max()) <= m.max_seq_len,
          f"max_seq_len {m.max_seq_len} is below the longest sequence ({int(m.seq_lens.max())})")
    if m.slot_mapping is not None:
        _need(m.slot_mapping.shape[0] == int(qsl[-1]),
              f"slot_mapping has {m.slot_mapping.shape[0]} slots for {int(qsl[-1])} query tokens")


def check_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
) -> None:
    """Refuses attention inputs that any path would mis-handle (one rule for CPU and Triton)."""
    _need(query.dim() == 3, f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    num_tokens, num_heads, head_size = query.shape
    _need(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
          f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(kv_cache.shape)}")
    num_kv_heads = kv_cache.shape[3]
    _need(kv_cache.shape[4] == head_size,
          f"kv_cache head_size {kv_cache.shape[4]} != query head_size {head_size}")
    _need(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
          f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads: "
          f"each kv head must serve a whole group of query heads (GQA)")
    _need(query.dtype in ATTENTION_DTYPES,
          f"query dtype {query.dtype} unsupported; use one of {', '.join(map(str, ATTENTION_DTYPES))}")
    _need(query.dtype == kv_cache.dtype,
          f"query {query.dtype} and kv_cache {kv_cache.dtype} differ: cast the query to the cache dtype")
    _need(out.shape == query.shape and out.dtype == query.dtype,
          f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
    for name, t in (("kv_cache", kv_cache), ("out", out), ("metadata", meta.seq_lens)):
        _need(t.device == query.device, f"{name} is on {t.device}, query on {query.device}")
    _need(query.stride(2) == out.stride(2) == kv_cache.stride(4) == 1,
          "the head_size dimension of query, out and kv_cache must be contiguous")
    if query.device.type == "cpu":
        _check_table(query, kv_cache, meta)


def _check_table(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    # Every block a sequence reads must be a block of this cache; padding past it is ignored.
    num_tokens = int(meta.query_start_loc[-1])
    _need(num_tokens == query.shape[0],
          f"query has {query.shape[0]} tokens, query_start_loc says {num_tokens}")
    block_size, num_blocks = kv_cache.shape[2], kv_cache.shape[1]
    if (num_blocks, block_size) in meta._tables_checked:
        return
    needed = (meta.seq_lens.to(torch.int64) + block_size - 1) // block_size
    _need(meta.num_seqs == 0 or int(needed.max()) <= meta.block_tables.shape[1],
          f"block_tables has {meta.block_tables.shape[1]} columns; the longest sequence needs "
          f"{int(needed.max()) if meta.num_seqs else 0} blocks of {block_size}")
    used = torch.arange(meta.block_tables.shape[1]) < needed[:, None]
    ids = meta.block_tables[used]
    _need(ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_blocks),
          f"block_tables name blocks outside [0, {num_blocks}) within the sequences' lengths")
    meta._tables_checked.add((num_blocks, block_size))


def check_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Refuses reshape_and_cache inputs (one rule for CPU and Triton)."""
    _need(key.dim() == 3 and key.shape == value.shape,
          f"key/value must be [num_tokens, num_kv_heads, head_size] and equal, got "
          f"{tuple(key.shape)} / {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape
    _need(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
          f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(kv_cache.shape)}")
    _need(tuple(kv_cache.shape[3:]) == (num_kv_heads, head_size),
          f"kv_cache heads/head_size {tuple(kv_cache.shape[3:])} != key's {(num_kv_heads, head_size)}")
    _need(key.dtype == value.dtype == kv_cache.dtype,
          f"key/value/kv_cache dtypes differ: {key.dtype}, {value.dtype}, {kv_cache.dtype}; "
          f"cast key and value to the cache dtype")
    _need(slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64,
          f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _need(key.device == value.device == kv_cache.device == slot_mapping.device,
          f"key, value, kv_cache and slot_mapping must share a device, got {key.device}, "
          f"{value.device}, {kv_cache.device}, {slot_mapping.device}")
    _need(key.stride(2) == value.stride(2) == kv_cache.stride(4) == 1,
          "the head_size dimension of key, value and kv_cache must be contiguous")
    if kv_cache.device.type == "cpu" and num_tokens:
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        _need(int(slot_mapping.min()) >= -1 and int(slot_mapping.max()) < num_slots,
              f"slot_mapping must hold -1 (skip) or slots in [0, {num_slots})")


def check_copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Refuses copy_blocks inputs (one rule for CPU and Triton)."""
    _need(bool(kv_caches), "kv_caches is empty: pass every layer's cache")
    first = kv_caches[0]
    _need(first.dim() == 5 and first.shape[0] == 2,
          f"each kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(first.shape)}")
    _need(all(c.shape == first.shape and c.stride() == first.stride() and c.dtype == first.dtype
              and c.device == first.device for c in kv_caches),
          "all layers' kv_caches must share shape, strides, dtype and device")
    _need(block_mapping.dim() == 2 and block_mapping.shape[1] == 2 and block_mapping.dtype == torch.int64,
          f"block_mapping must be int64 [n, 2] of (src, dst), got {block_mapping.dtype} {tuple(block_mapping.shape)}")
    if block_mapping.device.type == "cpu" and block_mapping.numel():
        num_blocks = first.shape[1]
        _need(int(block_mapping.min()) >= 0 and int(block_mapping.max()) < num_blocks,
              f"block_mapping names blocks outside [0, {num_blocks})")
        dst = block_mapping[:, 1].tolist()
        _need(len(set(dst)) == len(dst) and not set(dst) & set(block_mapping[:, 0].tolist()),
              "block_mapping destinations must be distinct and must not be sources of the same call")
