"""A plain contiguous-KV implementation of the same model: the truth the paged worker is tested
against. One request at a time, one K/V slab per layer, attention by explicit softmax in fp32.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvpool.worker.model import AttendFn, LlamaForCausalLM


class ContiguousKV:
    """One request's K/V per layer: k, v [max_len, num_kv_heads, head_size]."""

    def __init__(self, model: LlamaForCausalLM, max_len: int) -> None:
        cfg = model.config
        p = next(model.parameters())
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_size)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
        self.scale = cfg.head_size**-0.5

    def attend_at(self, start: int) -> AttendFn:
        """An attend function for new tokens at positions [start, start + T)."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t, num_heads, d = q.shape
            end = start + t
            self.k[layer, start:end], self.v[layer, start:end] = k, v
            keys, values = self.k[layer, :end].float(), self.v[layer, :end].float()
            kvh = keys.shape[1]
            qg = q.float().view(t, kvh, num_heads // kvh, d)
            scores = torch.einsum("tkgd,lkd->kgtl", qg, keys) * self.scale
            q_pos = torch.arange(start, end, device=q.device)[:, None]
            k_pos = torch.arange(end, device=q.device)[None, :]
            allowed = k_pos <= q_pos
            window = self.windows[layer]
            if window is not None:
                allowed &= k_pos > q_pos - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = torch.einsum("kgtl,lkd->tkgd", scores.softmax(-1), values)
            return out.reshape(t, num_heads, d).to(q.dtype)

        return attend


@torch.no_grad()
def reference_generate(
    model: LlamaForCausalLM, prompt: list[int], max_tokens: int, eos_token_id: int | Collection[int] | None = None
) -> list[int]:
    """Greedy decoding with a contiguous KV slab: prefill the prompt, then one token per step, up
    to an id of ``eos_token_id`` (one id or several)."""
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    device = next(model.parameters()).device
    cache = ContiguousKV(model, len(prompt) + max_tokens)
    tokens, out = list(prompt), []
    start, new = 0, list(prompt)
    while len(out) < max_tokens:
        ids = torch.tensor(new, dtype=torch.long, device=device)
        pos = torch.arange(start, start + len(new), device=device)
        hidden = model(ids, pos, cache.attend_at(start))
        tok = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(tok)
        tokens.append(tok)
        if tok in stops:
            break
        start, new = len(tokens) - 1, [tok]
    return out
