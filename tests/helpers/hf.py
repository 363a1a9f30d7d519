"""Tiny random-weight checkpoints saved by transformers itself (``save_pretrained``), in the
transformers 5 layout it writes or rewritten into the 4.x layout, and its greedy ``generate``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import transformers

V, H, FF, LAYERS, NH, KVH = 96, 64, 96, 2, 4, 2
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
CASES = {  # name: (config class, config fields)
    "llama": ("LlamaConfig", {}),
    "llama-llama3": ("LlamaConfig", {"rope_parameters": {**LLAMA3, "rope_theta": 50_000.0}}),
    "llama-linear-tied-hd80": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 10_000.0},
                                               "tie_word_embeddings": True, "head_dim": 80}),
    "qwen2-tied-sliding": ("Qwen2Config", {"tie_word_embeddings": True, "use_sliding_window": True,
                                           "sliding_window": 6, "max_window_layers": 1}),
    "mistral": ("MistralConfig", {"sliding_window": 10, "head_dim": 24}),
}


@torch.no_grad()
def _init(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations (transformers' 0.02 init gives near-uniform logits: ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:  # Qwen2's q/k/v biases
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        else:
            std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            p.copy_(std * torch.randn(p.shape, generator=g))


def build(case: str, seed: int = 0, eos: int | list[int] = 1, **extra):
    """A transformers model of ``case`` in fp32 eval mode."""
    cls, fields = CASES[case]
    config = getattr(transformers, cls)(
        vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=NH,
        num_key_value_heads=KVH, max_position_embeddings=256, eos_token_id=eos, bos_token_id=0, pad_token_id=0,
        **{**fields, **extra})
    architecture = cls.replace("Config", "ForCausalLM")
    model = getattr(transformers, architecture)(config).float().eval()
    _init(model, seed)
    return model


def save(model, path: Path, layout: str = "5", shard_size: str | None = None) -> Path:
    """``save_pretrained``; layout "4" moves RoPE to top-level ``rope_theta``/``rope_scaling`` and
    drops ``layer_types``, as a transformers 4.x config.json has them."""
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    if layout == "4":
        cfg_file = path / "config.json"
        cfg = json.loads(cfg_file.read_text())
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
        cfg.pop("layer_types", None)
        cfg_file.write_text(json.dumps(cfg))
    return path


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """``generate(do_sample=False)``: the new tokens, the stopping eos included."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(seed: int, shared: int = 20, lens: tuple[int, ...] = (5, 11, 23, 2)) -> list[list[int]]:
    """Prompts sharing a ``shared``-token prefix (prefix hits), no token below 3 (eos stays out)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, V) for _ in range(shared)]
    return [prefix + [rng.randrange(3, V) for _ in range(n)] for n in lens]
