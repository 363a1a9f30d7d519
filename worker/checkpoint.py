"""Models by name: a preset with seeded random weights, or a local Hugging Face-format checkpoint
directory (config.json + *.safetensors) of a Llama, Mistral or Qwen2 model. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvpool.worker.config import PRESETS, ModelConfig
from kvpool.worker.model import LlamaForCausalLM, build_model, empty_model

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def config_from_hf(hf: dict, name: str = "checkpoint") -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{name}: architecture {arch!r} is not supported; supported: {ARCHITECTURES}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{name}: attention_bias/mlp_bias on o_proj or the MLP is not supported")
    eos = hf.get("eos_token_id")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "MistralForCausalLM") else None
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_size=hf.get("head_dim") or 0,
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        rope_scaling=hf.get("rope_scaling"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 4096),
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=name,
    )


def load_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face-format checkpoint")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (.bin checkpoints are not supported)")
    cfg = config_from_hf(json.loads(cfg_file.read_text()), name=path.name)
    model = empty_model(cfg, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and cfg.tie_embeddings):
                        continue
                    if key not in params:
                        raise ValueError(f"{file.name}: unexpected tensor {key!r} for a {cfg.name} model")
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(params[key].shape):
                        raise ValueError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, "
                                         f"config.json implies {tuple(params[key].shape)}")
                    params[key].copy_(tensor)
                    loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model


def load_model(name_or_path: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    """A preset name (random weights from ``seed``) or a checkpoint directory."""
    if name_or_path in PRESETS:
        return build_model(PRESETS[name_or_path], dtype, device, seed)
    if Path(name_or_path).is_dir():
        return load_checkpoint(name_or_path, dtype, device)
    raise ValueError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                     f"nor a checkpoint directory")


def load_config(name_or_path: str) -> ModelConfig:
    """The shape of a preset or a checkpoint directory, without loading any weights."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    cfg_file = Path(name_or_path) / "config.json"
    if cfg_file.is_file():
        return config_from_hf(json.loads(cfg_file.read_text()), name=Path(name_or_path).name)
    raise ValueError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                     f"nor a checkpoint directory")
