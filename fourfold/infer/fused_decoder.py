"""The inference forward of a fourfold Llama with fused weights: one q|k|v and one gate|up matmul per layer.

    decoder = FusedDecoder.from_model(model)      # None when the model cannot be fused (see below)
    logits = decoder(st, pool, attend)             # st: StepTensors; same logits as model(..., cache=PagedStep)

`from_model` concatenates each block's wq, wk, wv (and biases) into one (hq + 2 hkv) * d by dim matrix
and w1, w3 into one 2 * ffn by dim matrix, then points the model's own Linear weights at slices of those
(views: no extra memory, and the model's eager forward still works, for inference). Per layer the
step then runs: add+RMSNorm, qkv matmul, rotary + KV-cache write, paged attention, output matmul,
add+RMSNorm, gate|up matmul, SiLU*mul, down matmul (fourfold.infer.fused_ops: one Triton kernel each on
CUDA), instead of about thirty small eager kernels. Tensor-parallel (DTensor weights) and pipeline-stage
models are left alone (`from_model` returns None) and run the model's own forward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.infer.fused_ops import add_rms_norm, rotary_kv_write, silu_mul
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.step_tensors import StepTensors

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attend(layer_idx, q (T, hq, d), k_cache, v_cache) -> (T, hq, d): attention over the already-written pool."""


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for `linears` stacked by output rows; each Linear then holds a view of it."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears], dim=0) if has_bias else None
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias


def can_fuse(model: nn.Module) -> bool:
    """Whether `model` is a whole fourfold Llama with plain nn.Linear, non-DTensor weights."""
    if getattr(model, "tok_embeddings", None) is None or getattr(model, "output", None) is None:
        return False
    if getattr(model, "norm", None) is None or not hasattr(model, "layers"):
        return False
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return False
    for block in model.layers.values():  # plain floating-point Linears only (not packed or quantized ones)
        att, ffn = block.attention, block.feed_forward
        linears = [att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w2, ffn.w3]
        if any(type(lin) is not nn.Linear or not lin.weight.is_floating_point() for lin in linears):
            return False
    return True


class _FusedBlock:
    """One transformer block's tensors for the fused forward."""

    def __init__(self, block: nn.Module):
        att, ffn = block.attention, block.feed_forward
        self.attn_norm, self.ffn_norm = block.attention_norm.weight, block.ffn_norm.weight
        self.eps = block.attention_norm.eps
        self.n_heads = att.wq.weight.shape[0] // att.head_dim
        self.n_kv_heads = att.wk.weight.shape[0] // att.head_dim
        self.head_dim = att.head_dim
        self.qkv, self.qkv_bias = _fuse([att.wq, att.wk, att.wv])
        self.gate_up, self.gate_up_bias = _fuse([ffn.w1, ffn.w3])
        self.wo, self.wo_bias = att.wo.weight, att.wo.bias
        self.w2, self.w2_bias = ffn.w2.weight, ffn.w2.bias


class FusedDecoder:
    """A fourfold Llama's paged-step forward over fused weights (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.blocks = [(int(name), _FusedBlock(block)) for name, block in model.layers.items()]

    @classmethod
    def from_model(cls, model: nn.Module) -> "FusedDecoder | None":
        """A decoder over `model`'s weights, fused in place; None for tensor-parallel or pipeline-stage models."""
        return cls(model) if can_fuse(model) else None

    @torch.inference_mode()
    def __call__(self, st: StepTensors, pool: KVPool, attend: Attend) -> torch.Tensor:
        """Logits (len(st.logits_for), vocab) in the model dtype for one engine step; writes the step's K/V to `pool`."""
        m = self.model
        x = m.tok_embeddings(st.tokens)  # (T, dim)
        cos, sin = m.rope_cos, m.rope_sin
        residual = None
        for layer_idx, b in self.blocks:
            normed, residual = add_rms_norm(x, residual, b.attn_norm, b.eps)
            qkv = F.linear(normed, b.qkv, b.qkv_bias)
            k_cache, v_cache = pool.layer(layer_idx)
            q = rotary_kv_write(qkv, st.positions, cos, sin, k_cache, v_cache, st.slot_mapping, b.n_heads,
                                b.n_kv_heads)
            out = attend(layer_idx, q, k_cache, v_cache)
            x = F.linear(out.reshape(out.shape[0], -1), b.wo, b.wo_bias)
            normed, residual = add_rms_norm(x, residual, b.ffn_norm, b.eps)
            x = F.linear(silu_mul(F.linear(normed, b.gate_up, b.gate_up_bias)), b.w2, b.w2_bias)
        h = (x + residual)[st.logits_for]
        h, _ = add_rms_norm(h, None, m.norm.weight, m.norm.eps)
        return m.output(h)
