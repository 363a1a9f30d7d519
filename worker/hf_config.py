"""A ModelConfig from a Hugging Face checkpoint's config.json and generation_config.json, read as
transformers 5 reads them (checked against transformers 5.24.0: tests/worker/test_hf_parity.py).

- RoPE: transformers 5 writes ``rope_parameters`` ({rope_type, rope_theta, scaling keys});
  transformers 4 wrote top-level ``rope_theta`` and ``rope_scaling``. Both are read; as in
  transformers, ``rope_scaling`` wins over ``rope_parameters`` and a theta inside the dict wins over
  the top-level one. Types default, linear and llama3 are computed; every other one is refused.
- Sliding window: Mistral applies ``sliding_window`` on every layer; Qwen2 only with
  ``use_sliding_window``, and only on the layers ``layer_types`` marks "sliding_attention" (when
  absent: layers from ``max_window_layers`` on); Llama has none.
- End of generation: every id of ``eos_token_id`` (an int or a list), from generation_config.json
  when it names one (as ``generate`` does), else from config.json.

Anything else the model would compute differently is refused with the field that says so.
"""

from __future__ import annotations

from kvpool.worker.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


def config_from_hf(hf: dict, name: str = "checkpoint", generation: dict | None = None) -> ModelConfig:
    """A ModelConfig from config.json (``hf``) and generation_config.json (``generation``)."""
    arch = architecture(hf, name)
    theta, scaling = rope_from_hf(hf, name)
    window, layers = sliding_from_hf(hf, arch, name)
    eos = eos_from_hf(hf, generation, name)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_size=hf.get("head_dim") or 0,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 4096),
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
        sliding_layers=layers,
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
        name=name,
    )


def architecture(hf: dict, name: str) -> str:
    """The architecture, after refusing what this model would compute differently."""
    archs = hf.get("architectures") or ["?"]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{name}: config.json architectures {archs} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    arch = archs[0]
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
        raise ValueError(f"{name}: config.json attention_bias is true (biases on q/k/v/o_proj); only Qwen2's "
                         f"q/k/v biases are supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{name}: config.json mlp_bias is true (biases in the MLP) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: config.json hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    if hf.get("quantization_config"):
        raise ValueError(f"{name}: config.json quantization_config: quantized checkpoints are not supported")
    return arch


def rope_from_hf(hf: dict, name: str) -> tuple[float, dict | None]:
    """(theta, scaling for worker/model.py ``rope_inv_freq`` or None) from either layout."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(field) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{name}: config.json {field} holds one RoPE per layer type ({sorted(params)}); "
                         f"only one RoPE for every layer is supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{name}: config.json {field}.rope_type {kind!r} is not supported "
                         f"({', '.join(ROPE_TYPES)} are)")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{name}: config.json partial_rotary_factor {partial} is not supported (RoPE on the "
                         f"whole head only)")
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
    return theta, scaling


def sliding_from_hf(hf: dict, arch: str, name: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers it applies to; None: every layer)."""
    if arch == "LlamaForCausalLM":
        return None, None
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM" or window is None:
        return window, None
    if not hf.get("use_sliding_window", False):
        return None, None
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        return window, tuple(range(first, num_layers))
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{name}: config.json layer_types must give one of {LAYER_TYPES} for each of the "
                         f"{num_layers} layers, got {types}")
    return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def eos_from_hf(hf: dict, generation: dict | None, name: str) -> tuple[int, ...]:
    ids = (generation or {}).get("eos_token_id")
    if ids is None:
        ids = hf.get("eos_token_id")
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"{name}: eos_token_id must be a token id or a list of them, got {ids!r}")
    return tuple(ids)
