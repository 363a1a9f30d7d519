"""Runs a batch: copy-on-write copies, batch metadata, the forward pass over the paged cache.

Metadata (DESIGN.md, "Kernels"): ``query_start_loc`` int32 prefix sums of the query lengths,
``seq_lens`` int32 context including the new tokens, ``block_table`` int32 padded with the null
block 0, ``slot_mapping`` int64 ``block * block_size + offset`` for every new token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.kernels import copy_blocks, paged_attention, reshape_and_cache
from kvpool.worker.kv_cache import allocate_kv_caches
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.step_plan import Batch


@dataclass
class BatchMetadata:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [R] int64: the last token of each sampling sequence


def build_metadata(plan: Batch, block_size: int, device: torch.device | str) -> BatchMetadata:
    seqs = plan.seqs
    q_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64)
    starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=qsl[1:])
    num_tokens = int(qsl[-1])
    # position of token t of sequence s: starts[s] + (t - qsl[s])
    positions = torch.repeat_interleave(starts - qsl[:-1], q_lens) + torch.arange(num_tokens)
    width = max(len(s.block_table) for s in seqs)
    table = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                         dtype=torch.int32)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    slots = table[seq_of_token, positions // block_size].to(torch.int64) * block_size + positions % block_size
    sample = torch.tensor([s.sample for s in seqs], dtype=torch.bool)
    ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return BatchMetadata(
        input_ids=dev(ids), positions=dev(positions), query_start_loc=dev(qsl.to(torch.int32)),
        seq_lens=dev((starts + q_lens).to(torch.int32)), block_table=dev(table),
        slot_mapping=dev(slots), logits_indices=dev(qsl[1:][sample] - 1),
    )


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.scale = model.config.head_size**-0.5
        self.window = model.config.sliding_window

    @property
    def kv_bytes(self) -> int:
        """Bytes of this shard's KV tensors (a tensor-parallel rank holds its slice of heads)."""
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    @torch.inference_mode()
    def execute(self, plan: Batch, *, sample: bool = True) -> torch.Tensor | None:
        """fp32 logits [R, vocab] for the plan's sampling sequences, in plan order; None without
        ``sample`` (a tensor-parallel follower only writes its KV slice and joins the all-reduces)."""
        if plan.copies:  # copy-on-write orders from the manager, before any write of this step
            mapping = torch.tensor(plan.copies, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_caches, mapping)
        meta = build_metadata(plan, self.block_size, self.device)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache = self.kv_caches[layer]
            reshape_and_cache(k, v, cache, meta.slot_mapping)
            return paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                   self.scale, sliding_window=self.window)

        hidden = self.model(meta.input_ids, meta.positions, attend)
        if not sample:
            return None
        return self.model.compute_logits(hidden[meta.logits_indices])


def allocate_runner(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> ModelRunner:
    """A runner over fresh KV tensors of ``num_blocks`` blocks: this shard's heads, the model's
    dtype and device."""
    cfg, p = model.config, next(model.parameters())
    caches = allocate_kv_caches(cfg.num_layers, num_blocks, block_size, model.local_kv_heads, cfg.head_size,
                                p.dtype, p.device)
    return ModelRunner(model, caches, block_size)
