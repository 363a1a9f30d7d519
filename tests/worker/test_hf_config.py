"""config.json as transformers writes it (``to_dict`` of its own config classes): what is read, and
what is refused with the field that says so."""

from __future__ import annotations

import json

import pytest
import transformers
from helpers.hf import build, save

from kvpool.worker.checkpoint import load_config
from kvpool.worker.hf_config import config_from_hf

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def written(cls: str, layout: str = "5", **fields) -> dict:
    """config.json of a ``cls`` config (transformers 5 layout), or with RoPE moved top-level ("4")."""
    cfg = getattr(transformers, cls)(**SHAPE, **fields).to_dict()
    cfg["architectures"] = [cls.replace("Config", "ForCausalLM")]
    if layout == "4":
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    return cfg


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10_000.0}


@pytest.mark.parametrize("cls, layout, fields, match", [
    ("LlamaConfig", "5", {"rope_parameters": YARN}, r"rope_parameters\.rope_type 'yarn' is not supported"),
    ("LlamaConfig", "4", {"rope_parameters": YARN}, r"rope_scaling\.rope_type 'yarn' is not supported"),
    ("LlamaConfig", "5", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_type 'dynamic' is not supported \(default, linear, llama3 are\)"),
    ("LlamaConfig", "5", {"attention_bias": True}, r"attention_bias is true"),
    ("LlamaConfig", "5", {"mlp_bias": True}, r"mlp_bias is true"),
    ("LlamaConfig", "5", {"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ("MistralConfig", "5", {"attention_bias": True}, r"attention_bias is true"),
    ("GemmaConfig", "5", {}, r"architectures \['GemmaForCausalLM'\] is not supported"),
    ("Gemma2Config", "5", {}, r"architectures \['Gemma2ForCausalLM'\] is not supported"),
])
def test_unsupported_configs_are_refused_naming_the_field(cls, layout, fields, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(written(cls, layout, **fields), "m")


def test_hand_edited_refusals():
    cfg = written("LlamaConfig")
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        config_from_hf({**cfg, "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="one RoPE per layer type"):
        config_from_hf({**cfg, "rope_parameters": {"full_attention": cfg["rope_parameters"],
                                                   "sliding_attention": cfg["rope_parameters"]}})
    qwen = written("Qwen2Config", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="layer_types must give one of"):
        config_from_hf({**qwen, "layer_types": ["full_attention"] * 3 + ["chunked_attention"]})
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list"):
        config_from_hf({**cfg, "eos_token_id": "</s>"})


@pytest.mark.parametrize("layout", ["5", "4"])
def test_rope_read_from_either_layout(layout):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64, "rope_theta": 500_000.0}
    cfg = config_from_hf(written("LlamaConfig", layout, rope_parameters=llama3))
    assert cfg.rope_theta == 500_000.0
    assert cfg.rope_scaling == {k: v for k, v in llama3.items() if k != "rope_theta"}
    plain = config_from_hf(written("LlamaConfig", layout, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6}))
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)
    linear = config_from_hf(written("LlamaConfig", layout, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                              "rope_theta": 1e4}))
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_qwen2_sliding_layers_as_transformers_marks_them():
    cfg = config_from_hf(written("Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert (cfg.sliding_window, cfg.sliding_layers) == (8, (2, 3))
    assert [cfg.window_of(i) for i in range(4)] == [None, None, 8, 8]
    no_types = written("Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    del no_types["layer_types"]  # a transformers 4 config.json: max_window_layers decides
    assert config_from_hf(no_types).sliding_layers == (1, 2, 3)
    explicit = written("Qwen2Config", use_sliding_window=True, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    assert config_from_hf(explicit).sliding_layers == (0, 2)
    off = config_from_hf(written("Qwen2Config", use_sliding_window=False, sliding_window=8))
    assert off.sliding_window is None and off.window_of(3) is None
    mistral = config_from_hf(written("MistralConfig", sliding_window=16))
    assert (mistral.sliding_window, mistral.sliding_layers, mistral.window_of(0)) == (16, None, 16)
    assert config_from_hf(written("LlamaConfig")).sliding_window is None


def test_generation_config_eos_list_wins(tmp_path):
    model = build("llama", eos=[1, 7])
    save(model, tmp_path)
    assert load_config(str(tmp_path)).eos_token_ids == (1, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5, 9]}))
    cfg = load_config(str(tmp_path))
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (3, (3, 5, 9))
    (tmp_path / "generation_config.json").unlink()
    assert load_config(str(tmp_path)).eos_token_ids == (1, 7)
