"""Runs a batch: copy-on-write copies, batch metadata, the forward pass over the paged cache.

The attention part of the metadata is one ``AttentionMetadata`` (kvpool.kernels, DESIGN.md
"Kernels"), built once per step from host lists and checked there; every layer's attention call
takes it as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpool.kernels import AttentionMetadata, copy_blocks, paged_attention, reshape_and_cache
from kvpool.shared.node_orders import NodeReport, Save
from kvpool.worker.host_kv import HostCopier, HostCopyStats
from kvpool.worker.kv_cache import allocate_kv_caches
from kvpool.worker.model import LlamaForCausalLM
from kvpool.worker.node_copier import NodeCopier, covered_blocks, recompute, unwritten_blocks
from kvpool.worker.step_plan import Batch

if TYPE_CHECKING:
    from kvpool.worker.node_agreement import NodeAgreement


@dataclass
class BatchMetadata:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata  # query_start_loc, seq_lens, block_tables, slot_mapping, scale, ...
    logits_indices: torch.Tensor  # [R] int64: the last token of each sampling sequence


def build_metadata(plan: Batch, block_size: int, device: torch.device | str, scale: float = 1.0,
                   sliding_window: int | None = None) -> BatchMetadata:
    seqs = plan.seqs
    q_lens = [len(s.token_ids) for s in seqs]
    seq_lens = [s.start + n for s, n in zip(seqs, q_lens, strict=True)]
    attn = AttentionMetadata.from_lengths(
        q_lens, seq_lens, [s.block_table for s in seqs], scale, block_size=block_size,
        sliding_window=sliding_window, device=device,
    )
    q = torch.tensor(q_lens, dtype=torch.int64)
    starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=qsl[1:])
    # position of token t of sequence s: starts[s] + (t - qsl[s])
    num_tokens = int(qsl[-1])
    positions = torch.repeat_interleave(starts - qsl[:-1], q, output_size=num_tokens) + torch.arange(num_tokens)
    sample = torch.tensor([s.sample for s in seqs], dtype=torch.bool)
    ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return BatchMetadata(input_ids=dev(ids), positions=dev(positions), attn=attn,
                         logits_indices=dev(qsl[1:][sample] - 1))


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.scale = model.config.head_size**-0.5
        self.windows = [model.config.window_of(i) for i in range(model.config.num_layers)]
        self.host: HostCopier | None = None  # the host tier's blocks and copies (worker/host_kv.py)
        self.node: NodeCopier | None = None  # the node tier's stores and copies (worker/node_copier.py)
        self.node_reports: list[NodeReport] = []  # batches run, for the manager (Engine sends them)
        # a tensor-parallel rank's: every rank's outcome of each node-tier run (worker/tp.py)
        self.agree: NodeAgreement | None = None

    def attach_host(self, num_blocks: int) -> None:
        """Host KV tensors of ``num_blocks`` blocks (none when 0). Tensors of that size already
        attached stay, with their contents: a re-registration with the same manager state (a
        restarted manager that recovered its journal) still names the blocks they hold."""
        if self.host is not None and self.host.num_blocks == num_blocks:
            return
        if self.host is not None:
            self.host.settle()  # nothing may still write into the tensors being dropped
        self.host = HostCopier(self.kv_caches, num_blocks) if num_blocks else None

    def attach_node(self, node: NodeCopier | None, agree: NodeAgreement | None = None) -> None:
        """The node tier's stores of this worker's layout (None: none); ``agree``: a
        tensor-parallel rank's agreement with the other ranks on each run (worker/node_agreement.py)."""
        if self.node is not None and self.node is not node:
            self.node.close()
        self.node, self.agree = node, agree if node is not None else None
        self.node_reports = []  # reports of batches of an earlier registration mean nothing now

    def take_node_reports(self) -> list[NodeReport]:
        out, self.node_reports = self.node_reports, []
        return out

    @property
    def host_caches(self) -> list[torch.Tensor]:
        return self.host.host_caches if self.host is not None else []

    @property
    def host_copies(self) -> HostCopyStats:
        """The host tier's copies so far (zeros without one): scripts/bench_tier.py reports them."""
        return self.host.stats if self.host is not None else HostCopyStats()

    @property
    def kv_bytes(self) -> int:
        """Bytes of this shard's KV tensors (a tensor-parallel rank holds its slice of heads)."""
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    @torch.inference_mode()
    def execute(self, plan: Batch, *, sample: bool = True) -> torch.Tensor | None:
        """fp32 logits [R, vocab] for the plan's sampling sequences, in plan order; None without
        ``sample`` (a tensor-parallel follower only writes its KV slice and joins the all-reduces)."""
        if plan.node_batch is not None and self.node is None:
            raise RuntimeError("the manager ordered node-tier copies but this worker has no node tier mapped")
        pre, failed, late, unwritten = plan.node_pre, [], [], set()
        if pre:  # in order; its loads into device blocks land below, after the host tier's saves
            # read them. It reads device blocks (and private host blocks) first: before any
            # device write of the step, and before the host tier's saves overwrite host blocks
            # it moves down (worker/node_copier.py)
            if self.host is not None and any(type(o) is Save and o.source == "private" for o in pre):
                self.host.settle()  # the private host blocks' last writes have landed
            private = self.host.host_caches if self.host is not None else None
            failed, late, unwritten = self.node.run(pre, private=private, defer_loads=True)  # type: ignore[union-attr]
            if self.agree is not None:  # what failed on any rank failed: each holds a slice of every block
                failed, late = self.agree.outcomes(pre, failed, late)
                unwritten = unwritten_blocks(failed)
        if self.host is not None:  # every step: the last step's saves and writes land (HostCopier.settle)
            # before anything overwrites or reads their blocks
            self.host.run(plan.saves, [] if pre else plan.loads)
        elif plan.saves or plan.loads or plan.writes:
            raise RuntimeError("the manager ordered host-tier copies but this worker has no host KV tensors")
        if pre:
            self.node.land_loads()  # type: ignore[union-attr]
            if self.host is not None and plan.loads:
                self.host.run([], plan.loads)
        if unwritten:  # never served: the forward pass computes them instead
            added = (self.agree.restart(plan, unwritten, self.block_size) if self.agree is not None
                     else recompute(plan, unwritten, self.block_size))
            self.node.count_recomputed(added)  # type: ignore[union-attr]
        logits = self._forward(plan, sample) if plan.seqs else None
        if plan.writes:  # write-through: the blocks this forward filled, behind its work
            self.host.write(plan.writes)
        if plan.node_batch is not None:
            if plan.node_post:
                post_failed = self.node.run(plan.node_post, covered_blocks(plan, self.block_size))[0]  # type: ignore[union-attr]
                if self.agree is not None:
                    post_failed = self.agree.outcomes(plan.node_post, post_failed, [])[0]
                failed += post_failed
            self.node_reports.append(NodeReport(plan.node_batch, tuple(failed), tuple(late)))
        return logits

    def _forward(self, plan: Batch, sample: bool) -> torch.Tensor | None:
        if plan.copies:  # copy-on-write orders from the manager, before any write of this step
            mapping = torch.tensor(plan.copies, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_caches, mapping)
        meta = build_metadata(plan, self.block_size, self.device, self.scale, self.windows[0])
        attn = meta.attn
        # Qwen2 slides its window on some layers only: one checked record per distinct window
        by_window = {w: attn if w == self.windows[0] else attn.with_options(sliding_window=w) for w in self.windows}

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache = self.kv_caches[layer]
            reshape_and_cache(k, v, cache, attn.slot_mapping)
            return paged_attention(q, cache, by_window[self.windows[layer]])

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
