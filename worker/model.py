"""A Llama-family decoder in plain torch: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Tokens are flattened across sequences (``[num_tokens, hidden]``, no batch dim): the caller gives
each token its position and an ``attend`` function that owns the KV cache. The paged runner
writes K/V into the paged cache and calls the kernels; the contiguous reference keeps one slab
per request. Module and parameter names follow Hugging Face's Llama/Qwen2 checkpoints, so a
checkpoint's state dict loads as is.

Tensor parallelism (worker/parallel.py's ``shard_model``) calls ``shard`` on the model: each
Attention and MLP keeps its rank's share, q/k/v/gate/up by output rows (``row_share``) and
o/down by input columns (``column_share``), its own head counts, and a ``reduce`` (an
all-reduce) for the row-parallel outputs; ``tp_rank``/``tp_size`` on the model say which share
it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.kernels import layer_ops
from kvpool.worker.config import ModelConfig

# (layer index, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """One shard holds the whole model: a row-parallel output is already the full sum."""
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of r, r) with r = x + residual, or x without one (vLLM's fused add and
        norm: one pass on CPU, kernels/layer_ops.py); ``residual`` may be updated in place."""
        return layer_ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_size: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_size // 2], with Llama-3 or linear scaling when configured."""
    inv = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])  # type: ignore[index]
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])  # type: ignore[index]
    old_len = float(scaling["original_max_position_embeddings"])  # type: ignore[index]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout) from a precomputed cos/sin table."""

    def __init__(self, head_size: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64),
                            rope_inv_freq(head_size, theta, scaling))
        self.register_buffer("cos", freqs.cos().float(), persistent=False)  # [max_pos, D/2]
        self.register_buffer("sin", freqs.sin().float(), persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D/2] of ``positions``; every q and k of a forward pass passes the same
        positions tensor, so they are looked up once a step, not twice a layer."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1], last[2]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        self._last = (positions, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; positions: [T]; may rotate x in place (kernels/layer_ops.py)
        return layer_ops.rope(x, positions, self.cos, self.sin, rows=lambda: self._tables(positions))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, cfg.head_size
        d = cfg.head_size
        self.q_proj = nn.Linear(cfg.hidden_size, num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(num_heads * d, cfg.hidden_size, bias=False)
        # q, k and v as one product once worker/cpu_linear.py packs them (q_proj... are then None)
        self.qkv_proj: nn.Module | None = None
        self.reduce: ReduceFn = no_reduce  # sums o_proj's partial outputs over tensor-parallel ranks

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_size
        return self.qkv_proj(x).split([self.num_heads * self.head_size, kv, kv], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attend: AttendFn, layer: int) -> torch.Tensor:
        t, d = x.shape[0], self.head_size
        q, k, v = self._qkv(x)
        q = rope(positions, q.view(t, self.num_heads, d))
        k = rope(positions, k.view(t, self.num_kv_heads, d))
        v = v.view(t, self.num_kv_heads, d)
        return self.reduce(self.o_proj(attend(layer, q, k, v).reshape(t, self.num_heads * d)))

    def shard(self, rank: int, size: int, reduce: ReduceFn) -> None:
        """Keeps rank ``rank``'s query and KV heads of ``size`` contiguous shares."""
        self.q_proj = row_share(self.q_proj, rank, size)
        self.k_proj = row_share(self.k_proj, rank, size)
        self.v_proj = row_share(self.v_proj, rank, size)
        self.o_proj = column_share(self.o_proj, rank, size)
        self.num_heads //= size
        self.num_kv_heads //= size
        self.reduce = reduce


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one product once packed
        self.reduce: ReduceFn = no_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            act = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            act = layer_ops.silu_mul(self.gate_up_proj(x))
        return self.reduce(self.down_proj(act))

    def shard(self, rank: int, size: int, reduce: ReduceFn) -> None:
        """Keeps rank ``rank``'s slice of the intermediate size."""
        self.gate_proj = row_share(self.gate_proj, rank, size)
        self.up_proj = row_share(self.up_proj, rank, size)
        self.down_proj = column_share(self.down_proj, rank, size)
        self.reduce = reduce


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.num_heads, cfg.num_kv_heads)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, residual, positions, rope, attend, layer):
        """(this layer's MLP output, the residual stream before it): the next layer, or the
        final norm, adds the two (so each add is fused with a norm, as vLLM's layers do)."""
        h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(h, positions, rope, attend, layer)
        h, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(h), residual


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_size, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.tp_rank, self.tp_size = 0, 1  # which share of the heads this model holds
        self.reduce: ReduceFn = no_reduce  # the ranks' sum (worker/tp.py agrees on node-tier runs with it)

    def shard(self, rank: int, size: int, reduce: ReduceFn) -> None:
        """Keeps rank ``rank``'s share of every layer (in place); ``reduce`` sums the row-parallel
        outputs over the ranks. Embeddings, norms and the LM head stay whole."""
        for layer in self.model.layers:
            layer.self_attn.shard(rank, size, reduce)
            layer.mlp.shard(rank, size, reduce)
        self.tp_rank, self.tp_size, self.reduce = rank, size, reduce

    @property
    def local_kv_heads(self) -> int:
        """KV heads this shard computes and caches (all of them without tensor parallelism)."""
        return self.config.num_kv_heads // self.tp_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        # input_ids, positions: [T] -> final hidden states [T, hidden]
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rotary, attend, i)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [R, hidden] -> fp32 logits [R, vocab]
        if self.lm_head is None:  # tied: the embedding table (dense, the lookup reads it too)
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # an nn.Linear, or its packed twin (worker/cpu_linear.py)


def row_share(linear: nn.Linear, rank: int, size: int) -> nn.Linear:
    """Rank ``rank``'s output rows of ``linear`` (column-parallel); the bias follows the rows."""
    # weight: [out, in] -> [out / size, in]
    share = linear.out_features // size
    rows = slice(rank * share, (rank + 1) * share)
    return _linear_of(linear.weight[rows], None if linear.bias is None else linear.bias[rows])


def column_share(linear: nn.Linear, rank: int, size: int) -> nn.Linear:
    """Rank ``rank``'s input columns of ``linear`` (row-parallel: its partial outputs are summed,
    so it can have no bias, which would be summed ``size`` times)."""
    # weight: [out, in] -> [out, in / size]
    if linear.bias is not None:
        raise ValueError("a row-parallel projection with a bias is not supported")
    share = linear.in_features // size
    return _linear_of(linear.weight[:, rank * share : (rank + 1) * share], None)


@torch.no_grad()
def _linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A Linear of contiguous copies of ``weight`` [out, in] and ``bias`` (a slice would keep the
    whole tensor's storage alive), its memory allocated uninitialised and filled once."""
    out = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                             device=weight.device, dtype=weight.dtype)
    out.weight.copy_(weight)
    if bias is not None:
        out.bias.copy_(bias)
    return out.requires_grad_(False)


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded weights with unit-scale activations, so greedy outputs are not degenerate."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
        std = 1.0 if "embed_tokens" in name else (p.shape[-1] if p.dim() > 1 else 64) ** -0.5
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    """A model of ``cfg`` with seeded random weights, in ``dtype`` on ``device``, in eval mode."""
    model = empty_model(cfg, dtype, device)
    init_random_weights(model, seed)
    return model


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """Uninitialised weights of ``cfg`` allocated once, on ``device``; RoPE tables stay fp32."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.rotary = RotaryEmbedding(cfg.head_size, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
    return model.to(device).eval()
