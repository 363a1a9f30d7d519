"""The attention metadata of one batch: a typed record that checks itself on construction.

``AttentionMetadata`` is built once per step (``from_lengths``) and handed to the dispatcher, the
Triton launch wrappers and the torch reference alike, instead of five loose arguments; checks.py
holds the per-call checks that both paths run. No triton import here: the reference must work
where triton is missing.

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

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
T = TypeVar("T")


class AttentionInputError(ValueError):
    """Attention inputs that no path accepts; the message says what to change."""


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
    # the torch reference's per-step plans (reference._plan), shared by the layers of a step
    _ref_plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.query_start_loc.device.type == "cpu":
            _check_values(self)

    def derived(self, key: tuple, build: Callable[[], T]) -> T:
        """``build()`` once per ``key`` for this batch: what a kernel path derives from the
        metadata and every layer of the step shares (the torch reference's plan)."""
        if key not in self._ref_plans:
            self._ref_plans[key] = build()
        return self._ref_plans[key]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def is_decode_only(self, num_tokens: int) -> bool:
        """Every sequence has exactly one new token (so split-KV decode applies).

        Decided from the query lengths: lengths bounded by 1 summing to num_seqs are all 1. A
        batch with empty queries ([2, 0]) has as many tokens as sequences but is not decode.
        """
        return self.max_query_len == 1 and num_tokens == self.num_seqs

    def with_options(self, sliding_window: int | None = None, softcap: float | None = None) -> AttentionMetadata:
        """This batch with one layer's own window and softcap (models that vary them by layer).

        Checks only the two options; the tensors, already checked, are shared (so is the record
        of checked block tables), which keeps a per-layer call cheap.
        """
        _check_options(sliding_window, softcap)
        other = copy.copy(self)  # no __post_init__: nothing but the options changes
        object.__setattr__(other, "sliding_window", sliding_window)
        object.__setattr__(other, "softcap", softcap)
        return other

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
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise AttentionInputError(
                f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
                f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
            )
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
        if not (t.dtype == dtype and tuple(t.shape) == shape):
            raise AttentionInputError(
                f"{name} must be {dtype} of shape {shape} (num_seqs {num_seqs}), got "
                f"{t.dtype} {tuple(t.shape)}"
            )
        if not (t.device == m.seq_lens.device):
            raise AttentionInputError(
                f"{name} is on {t.device}, seq_lens on {m.seq_lens.device}"
            )
    if not (m.query_start_loc.is_contiguous() and m.seq_lens.is_contiguous() and (width <= 1 or m.block_tables.stride(1) == 1)):
        raise AttentionInputError(
            "query_start_loc, seq_lens and block_tables rows must be contiguous"
        )
    if m.slot_mapping is not None:
        if not (m.slot_mapping.dtype == torch.int64 and m.slot_mapping.dim() == 1):
            raise AttentionInputError(
                f"slot_mapping must be 1-D int64, got {m.slot_mapping.dtype} {tuple(m.slot_mapping.shape)}"
            )
    if not (m.max_query_len >= 0 and m.max_seq_len >= 0):
        raise AttentionInputError(
            f"max_query_len {m.max_query_len} and max_seq_len {m.max_seq_len} must be >= 0"
        )
    _check_options(m.sliding_window, m.softcap)
    if not (math.isfinite(m.scale)):
        raise AttentionInputError(
            f"scale must be finite, got {m.scale!r}"
        )


def _check_options(sliding_window: int | None, softcap: float | None) -> None:
    if not (sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1)):
        raise AttentionInputError(
            f"sliding_window must be None (no window) or an int >= 1, got {sliding_window!r}"
        )
    if not (softcap is None or (math.isfinite(softcap) and softcap > 0)):
        raise AttentionInputError(
            f"softcap must be None (no capping) or a finite number > 0, got {softcap!r}"
        )


def _check_values(m: AttentionMetadata) -> None:
    """Prefix sums, length bounds: the contents of CPU tensors."""
    qsl = m.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]
    if not (int(qsl[0]) == 0):
        raise AttentionInputError(
            f"query_start_loc must start at 0, got {int(qsl[0])}"
        )
    if m.num_seqs == 0:
        return
    if not (bool((q_lens >= 0).all())):
        raise AttentionInputError(
            f"query_start_loc must not decrease, got {qsl.tolist()}"
        )
    if not (int(q_lens.max()) <= m.max_query_len):
        raise AttentionInputError(
            f"max_query_len {m.max_query_len} is below the longest query ({int(q_lens.max())})"
        )
    if not (bool((q_lens <= m.seq_lens).all())):
        raise AttentionInputError(
            f"a query is longer than its sequence: query lengths {q_lens.tolist()}, "
            f"seq_lens {m.seq_lens.tolist()}"
        )
    if not (int(m.seq_lens.max()) <= m.max_seq_len):
        raise AttentionInputError(
            f"max_seq_len {m.max_seq_len} is below the longest sequence ({int(m.seq_lens.max())})"
        )
    if m.slot_mapping is not None:
        if not (m.slot_mapping.shape[0] == int(qsl[-1])):
            raise AttentionInputError(
                f"slot_mapping has {m.slot_mapping.shape[0]} slots for {int(qsl[-1])} query tokens"
            )
