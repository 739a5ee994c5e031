"""The seam between the model's attention and a KV cache: what a cache or attention-metadata object implements.

The model is written once for training and inference. Training calls `model(tokens, positions)` and
each block's attention runs its core (`Attention.core`: causal SDPA, or a context-parallel core) on
the whole sequence. Inference passes one more object, built by the caller for this forward step:

    step = cache.step(positions)                       # whatever the cache needs for this step
    logits = model(tokens, positions, cache=step, logits_for=last_token_indices)

and every block's attention, instead of calling its core, calls

    out = step.attend(layer_idx, q, k, v)

with the new tokens' rotated queries q (batch, q_heads, seq, head_dim) and keys / values
(batch, kv_heads, seq, head_dim), the same layout the core receives. `attend` stores k and v where
this step's tokens belong, attends each query to every cached key of its own sequence up to and
including its own position, and returns (batch, q_heads, seq, head_dim). `layer_idx` is the block's
index in the whole model (a pipeline stage's blocks keep their global indices), so one object can
serve every layer and every pipeline chunk. Head counts come from the tensors: under tensor
parallelism each rank sees and caches only its own heads.

Everything step-specific (per-token positions, which sequence each token belongs to, block tables,
slot mappings, masks, sequence lengths) lives in the object, so a paged cache with continuous
batching and chunked prefill plugs in by implementing `attend`, without changing the model. The
object is built once per step and used by every layer, so per-step work (masks, index tensors) is
done once, not per layer. fourfold.infer.kv_cache.KVCache is the contiguous implementation.

Positions are given to the model separately (they choose the rotary angles); a cache step must be
built for the same positions.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionCache(Protocol):
    """One forward step's KV-cache access: store this step's keys and values, attend over the cache."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v (b, hkv, s, d) of layer `layer_idx`; return attention of q (b, hq, s, d) over the cache."""
        ...
