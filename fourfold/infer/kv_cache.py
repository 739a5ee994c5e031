"""A simple contiguous KV cache and the cached forward pass of the Llama model, for generation.

The forward reuses the model's own modules (norms, projections, MLP, rotary tables); only attention
reads keys and values from the cache. The paged cache and batching engine are a later addition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.models.llama import Llama, apply_rotary


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `max_len` tokens."""

    def __init__(self, model: Llama, batch: int, max_len: int, device, dtype):
        cfg = model.cfg
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (b, hkv, s, d) at positions start..start+s; return the cached keys/values so far."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


@torch.no_grad()
def cached_forward(model: Llama, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """Logits (batch, vocab) of the last token of `tokens` (batch, s) placed at positions start..start+s."""
    b, s = tokens.shape
    if start + s > cache.max_len:
        raise ValueError(f"sequence of {start + s} tokens exceeds the cache's {cache.max_len}")
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[start:start + s], model.rope_sin[start:start + s]
    q_pos = torch.arange(start, start + s, device=tokens.device)
    k_pos = torch.arange(start + s, device=tokens.device)
    mask = q_pos[:, None] >= k_pos[None, :]
    for i, block in enumerate(model.layers.values()):
        attn = block.attention
        x = block.attention_norm(h)
        q = apply_rotary(attn.wq(x).view(b, s, -1, attn.head_dim), cos, sin).transpose(1, 2)
        k = apply_rotary(attn.wk(x).view(b, s, -1, attn.head_dim), cos, sin).transpose(1, 2)
        v = attn.wv(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
        keys, values = cache.append(i, start, k, v)
        repeat = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        h = h + attn.wo(out.transpose(1, 2).reshape(b, s, -1))
        h = h + block.feed_forward(block.ffn_norm(h))
    return model.output(model.norm(h[:, -1]))
