"""Loading Hugging Face-format checkpoints (config.json + safetensors) written by the test."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvpool.worker.checkpoint import load_checkpoint, load_model
from kvpool.worker.model import rope_inv_freq

H, FF, V, KVH, NH, D = 32, 48, 64, 2, 4, 8


def hf_tensors(qwen: bool, tied: bool, layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": r(NH * D, H), p + "self_attn.k_proj.weight": r(KVH * D, H),
                  p + "self_attn.v_proj.weight": r(KVH * D, H), p + "self_attn.o_proj.weight": r(H, NH * D),
                  p + "mlp.gate_proj.weight": r(FF, H), p + "mlp.up_proj.weight": r(FF, H),
                  p + "mlp.down_proj.weight": r(H, FF), p + "input_layernorm.weight": 1 + r(H),
                  p + "post_attention_layernorm.weight": 1 + r(H)})
        if qwen:
            for k, n in (("q", NH), ("k", KVH), ("v", KVH)):
                t[p + f"self_attn.{k}_proj.bias"] = r(n * D)
    if not tied:
        t["lm_head.weight"] = r(V, H)
    return t


def write(tmp_path, qwen: bool, tied: bool, shards: int = 1, **extra) -> dict[str, torch.Tensor]:
    tensors = hf_tensors(qwen, tied)
    cfg = {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "vocab_size": V,
           "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": 2, "num_attention_heads": NH,
           "num_key_value_heads": KVH, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 128, "tie_word_embeddings": tied, "eos_token_id": [2, 3], **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    keys = sorted(tensors)
    for s in range(shards):
        part = {k: tensors[k].contiguous() for k in keys[s::shards]}
        save_file(part, str(tmp_path / f"model-{s:05d}-of-{shards:05d}.safetensors"))
    return tensors


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def one_token_logits(t: dict, token: int, qwen: bool, tied: bool) -> torch.Tensor:
    """An independent forward of one token at position 0: attention returns v (RoPE is the identity)."""
    x = t["model.embed_tokens.weight"][token]
    for i in range(2):
        p = f"model.layers.{i}."
        v = F.linear(rms(x, t[p + "input_layernorm.weight"]), t[p + "self_attn.v_proj.weight"],
                     t.get(p + "self_attn.v_proj.bias")).view(KVH, D)
        x = x + F.linear(v.repeat_interleave(NH // KVH, 0).flatten(), t[p + "self_attn.o_proj.weight"])
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        act = F.silu(F.linear(h, t[p + "mlp.gate_proj.weight"])) * F.linear(h, t[p + "mlp.up_proj.weight"])
        x = x + F.linear(act, t[p + "mlp.down_proj.weight"])
    head = t["model.embed_tokens.weight"] if tied else t["lm_head.weight"]
    return F.linear(rms(x, t["model.norm.weight"]), head)


@pytest.mark.parametrize("qwen, tied, shards", [(False, False, 1), (True, True, 3), (True, False, 2)])
def test_load_matches_an_independent_forward(tmp_path, qwen, tied, shards):
    tensors = write(tmp_path, qwen, tied, shards)
    model = load_checkpoint(tmp_path, torch.float32, "cpu")
    cfg = model.config
    assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.eos_token_id, cfg.head_size) == (qwen, tied, 2, D)

    def attend_one(layer, q, k, v):
        return v.repeat_interleave(NH // KVH, 1)  # one token attends only to itself

    with torch.no_grad():
        for token in (0, 5, 63):
            hidden = model(torch.tensor([token]), torch.tensor([0]), attend_one)
            torch.testing.assert_close(model.compute_logits(hidden)[0], one_token_logits(tensors, token, qwen, tied),
                                       atol=1e-5, rtol=1e-5)
        if qwen:  # the q/k biases are loaded too
            assert torch.equal(model.model.layers[1].self_attn.k_proj.bias,
                               tensors["model.layers.1.self_attn.k_proj.bias"])


def test_missing_and_unexpected_tensors(tmp_path):
    write(tmp_path, qwen=False, tied=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForCausalLM"]  # expects biases the files lack
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks 6 tensors"):
        load_checkpoint(tmp_path, torch.float32, "cpu")


def test_bad_directories(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")
    write(tmp_path, qwen=False, tied=False, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="not supported"):
        load_checkpoint(tmp_path, torch.float32, "cpu")


def test_llama3_rope_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = rope_inv_freq(128, 500_000.0, None)
    scaled = rope_inv_freq(128, 500_000.0, scaling)
    assert torch.equal(scaled[:10], base[:10])  # high frequencies untouched
    torch.testing.assert_close(scaled[-5:], base[-5:] / 8)  # low frequencies divided by factor
    assert ((scaled <= base) & (scaled >= base / 8)).all()
