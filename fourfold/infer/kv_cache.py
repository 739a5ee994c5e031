"""A contiguous KV cache for generation: per layer one (batch, kv_heads, max_len, head_dim) buffer, written by position.

It implements the model's attention-cache seam (fourfold.models.attention): the model runs its own
forward, and each block's attention hands this step's keys and values to the cache.

    cache = KVCache(n_layers=len(model.layers), batch=2, max_len=64)
    positions = torch.arange(s).expand(2, s)           # per-token positions, one row per sequence
    logits = model(tokens, positions, cache=cache.step(positions), logits_for=last)

A token's keys and values go to its sequence's row at its position, and a query attends to the
keys at positions up to and including its own. So sequences of different lengths share a batch:
right-pad the shorter prompts (their padding writes slots that the sequence's own later tokens
overwrite before any query can see them), then feed each sequence's next token at its own position.
Buffers are allocated on first use with the keys' dtype, device and head count, so the cache follows
whatever the model computes in (and a tensor-parallel rank caches only its own heads).
The paged cache with continuous batching is the inference engine's; this one is for `generate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `max_len` positions."""

    def __init__(self, n_layers: int, batch: int, max_len: int):
        self.batch, self.max_len = batch, max_len
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    def step(self, positions: torch.Tensor) -> ContiguousCacheStep:
        """The attention cache for one forward over tokens at `positions` ((batch, seq), or (seq,) for every row)."""
        if positions.dim() == 1:
            positions = positions.expand(self.batch, -1)
        if positions.dim() != 2 or positions.shape[0] != self.batch:
            raise ValueError(f"positions must be (batch={self.batch}, seq), got shape {tuple(positions.shape)}")
        if int(positions.max()) >= self.max_len or int(positions.min()) < 0:
            raise ValueError(f"positions must lie in 0..{self.max_len - 1}, the cache's length")
        return ContiguousCacheStep(self, positions)

    def store(self, layer_idx: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (b, hkv, s, d) of layer `layer_idx` at (rows, positions); return that layer's buffers."""
        if self.keys[layer_idx] is None:
            shape = (self.batch, k.shape[1], self.max_len, k.shape[3])
            self.keys[layer_idx] = k.new_zeros(shape)
            self.values[layer_idx] = v.new_zeros(shape)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # Indexing (rows, :, positions) addresses (b, s, hkv, d): the heads move behind the tokens.
        keys[rows, :, positions] = k.transpose(1, 2)
        values[rows, :, positions] = v.transpose(1, 2)
        return keys, values


class ContiguousCacheStep:
    """One forward step over a KVCache: index tensors and the attention mask, built once for all layers."""

    def __init__(self, cache: KVCache, positions: torch.Tensor):
        self.cache = cache
        self.positions = positions
        self.rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.end = int(positions.max()) + 1  # no query of this step sees a key beyond this position
        key_positions = torch.arange(self.end, device=positions.device)
        # (b, 1, s, end): a query sees its own sequence's keys at its position and before.
        self.mask = (key_positions <= positions[..., None])[:, None]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k, v (b, hkv, s, d); attention (b, hq, s, d) of q over the cached keys."""
        keys, values = self.cache.store(layer_idx, self.rows, self.positions, k, v)
        keys, values = keys[:, :, :self.end], values[:, :, :self.end]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])
