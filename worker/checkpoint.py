"""Models by name: a preset with seeded random weights, or a local Hugging Face-format checkpoint
directory (config.json + *.safetensors) of a Llama, Mistral or Qwen2 model. Nothing is downloaded.
The configs are read by worker/hf_config.py; the weights follow ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvpool.worker.config import PRESETS, ModelConfig
from kvpool.worker.hf_config import config_from_hf
from kvpool.worker.model import LlamaForCausalLM, build_model, empty_model

INDEX = "model.safetensors.index.json"


def read_config(path: Path) -> ModelConfig:
    """config.json (+ generation_config.json) of a checkpoint directory (worker/hf_config.py)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face-format checkpoint")
    gen_file = path / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return config_from_hf(json.loads(cfg_file.read_text()), name=path.name, generation=generation)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers would load: those ``model.safetensors.index.json`` names
    when it exists, else ``model.safetensors``, else every ``*.safetensors`` (other files such as a
    ``consolidated.safetensors`` in another layout are left alone)."""
    index = path / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map: rewrite it or remove it")
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names files that are not there: {missing}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (.bin checkpoints are not supported)")
    return files


def load_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    path = Path(path)
    cfg = read_config(path)
    files = weight_files(path)
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
    if (Path(name_or_path) / "config.json").is_file():
        return read_config(Path(name_or_path))
    raise ValueError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                     f"nor a checkpoint directory")
