"""The inference forward of a fourfold Llama with fused weights: one q|k|v and one gate|up matmul per layer.

    decoder = FusedDecoder.from_model(model)      # None when the model cannot be fused (see below)
    logits = decoder(st, pool, attend)             # st: StepTensors; same logits as model(..., cache=PagedStep)

`from_model` concatenates each block's wq, wk, wv (and biases) into one (hq + 2 hkv) * d by dim matrix
and w1, w3 into one 2 * ffn by dim matrix, then points the model's own Linear weights at slices of those
(views: no extra memory, and the model's eager forward still works, for inference). Per layer the
step then runs: add+RMSNorm, qkv matmul, rotary + KV-cache write, paged attention, output matmul,
add+RMSNorm, gate|up matmul, SiLU*mul, down matmul (fourfold.infer.fused_ops: one Triton kernel each on
CUDA), instead of about thirty small eager kernels. Decode steps on CUDA can run rotary, KV write and attention
as one kernel instead (then the split-KV combine), fourfold.infer.decode_attention_gpu (FUSED_DECODE_ATTENTION;
the runner's `attend.with_rotary`). On CUDA, steps of few tokens (decode) run the matmuls as Triton GEMVs
(fourfold.infer.gemv_gpu), the gate|up one with SiLU*mul in its epilogue; the output head too. Converted
int4 models (fourfold.quant Int4WeightLinear in every block linear) fuse the same way, their packed nibbles,
scales and zero points stacked by rows, and run the module's own kernels (the tensor-core GEMV of
fourfold.quant.int4_mma up to its MAX_ROWS, 32, or fourfold.quant.int4_gemv, with SiLU*mul fused; the W4A16 GEMM
above).
Decode steps of such a model with weight-only int4 linears (no activation quantization) go further: each
RMSNorm runs inside the GEMV that reads it (its rstd from squares summed in the GEMV's own loop) and each
residual add in the epilogue of the GEMV before it, so a layer is q|k|v (norm), rotary, attention, o
(+ residual), gate|up (norm, SiLU*mul), down (+ residual): no add+RMSNorm kernels (INT4_FUSED_NORMS).
Tensor-parallel (DTensor weights) and pipeline-stage models are left alone (`from_model` returns None)
and run the model's own forward.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.infer.fused_ops import add_rms_norm, rotary_kv_write, silu_mul
from fourfold.infer.gemv_gpu import gemv_triton, use_gemv
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.step_tensors import StepTensors
from fourfold.quant.packing import Int4WeightLinear

INT4_FUSED_NORMS = True
"""Int4 weight-only models at decode (rows where Int4WeightLinear.uses_gemv: 1-32 on int4_mma): norms and residual adds
inside the int4 GEMVs, two kernels a layer fewer (H200, llama-1b batch 1: 0.639 against 0.661-0.674 ms/step;
bench/results/2026-11-24-h200-int4-v3/). The normed rows are not rounded to the activation dtype before the
matmuls (the separate kernels round them), so logits differ from the unfused path by about that rounding."""

FUSED_DECODE_ATTENTION = os.environ.get("FOURFOLD_DECODE_ATTENTION") != "0"
"""Decode steps of few sequences on CUDA (decode_attention_gpu.MAX_TOKENS): rotary + KV-cache write + attention
as one kernel, then the split combine (fourfold.infer.decode_attention_gpu, reached through
`attend.with_rotary`), instead of rotary_kv_write, the attention kernel and the combine. H200, llama-1b batch 1:
4.4-4.8 vs 5.3-5.8 us a layer; bf16 0.823 vs 0.882 ms/step (bench/results/2026-11-24-h200-decode-attention-v2/).
FOURFOLD_DECODE_ATTENTION=0 at import turns it off (A/B)."""

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attend(layer_idx, q (T, hq, d), k_cache, v_cache) -> (T, hq, d): attention over the already-written pool.
It may carry `attend.with_rotary(layer_idx, qkv, cos, sin, k_cache, v_cache, hq, hkv) -> (T, hq, d)`, which
does the rotary and KV-cache write too (fourfold.infer.model_runner gives it to decode steps on CUDA)."""


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


def _fuse_int4(linears: list[Int4WeightLinear]) -> Int4WeightLinear:
    """One Int4WeightLinear for `linears` stacked by output rows; each then holds views of its buffers. Parts that
    hold int4_mma's words (fourfold.quant.one_copy) stack as words (16-row blocks) where the stacked weight still
    fits the words' kernels, else every part goes back to the stored nibbles first."""
    first = linears[0]
    rows = sum(lin.out_features for lin in linears)
    fused = Int4WeightLinear(first.in_features, rows, first.bias is not None, first.scheme)
    names = ["scales", "zero_points"] + (["bias"] if first.bias is not None else []) + ["weight_int4"]
    stacked = {}
    for n in names:
        if n == "weight_int4" and any(lin.holds_words for lin in linears):   # fused's scales and bias are set
            if not (all(lin.holds_words for lin in linears) and fused.words_fit(first.weight_int4.device)):
                for lin in linears:
                    lin.to_stored()
        stacked[n] = torch.cat([getattr(lin, n) for lin in linears], dim=0)
        setattr(fused, n, stacked[n])
    for n in names:
        row = 0
        for lin in linears:
            part_rows = getattr(lin, n).shape[0]            # out_features, or out_features / 16 for words
            setattr(lin, n, stacked[n][row:row + part_rows])
            row += part_rows
    return fused


class _Linear:
    """One (possibly fused) projection: a float weight and bias, or a packed int4 module."""

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 packed: nn.Module | None = None):
        self.weight, self.bias, self.packed = weight, bias, packed

    @classmethod
    def of(cls, linears: list[nn.Module]) -> "_Linear":
        if isinstance(linears[0], Int4WeightLinear):
            return cls(packed=linears[0] if len(linears) == 1 else _fuse_int4(linears))
        if len(linears) == 1:
            return cls(linears[0].weight, linears[0].bias)
        return cls(*_fuse(linears))

    def __call__(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """x @ W.T + b; `gated` (W = [gate | up] by rows): silu(gate) * up."""
        if self.packed is not None:
            if gated and self.packed.uses_gemv(x):
                return self.packed(x, gated=True)
            y = self.packed(x)
        elif use_gemv(x, self.weight):
            return gemv_triton(x, self.weight, self.bias, gated=gated)
        else:
            y = F.linear(x, self.weight, self.bias)
        return silu_mul(y) if gated else y


def _block_linears_fuse(linears: list[nn.Module]) -> bool:
    """Plain floating-point Linears, or int4 modules of one scheme (not 8-bit or other packed modules)."""
    if all(type(lin) is nn.Linear and lin.weight.is_floating_point() for lin in linears):
        return True
    return (all(isinstance(lin, Int4WeightLinear) for lin in linears)
            and len({lin.scheme for lin in linears}) == 1)


def can_fuse(model: nn.Module) -> bool:
    """Whether `model` is a whole fourfold Llama with non-DTensor weights, its block linears plain or int4."""
    if getattr(model, "tok_embeddings", None) is None or getattr(model, "output", None) is None:
        return False
    if getattr(model, "norm", None) is None or not hasattr(model, "layers"):
        return False
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return False
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        if not _block_linears_fuse([att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w2, ffn.w3]):
            return False
    return True


class _FusedBlock:
    """One transformer block's tensors for the fused forward."""

    def __init__(self, block: nn.Module):
        att, ffn = block.attention, block.feed_forward
        self.attn_norm, self.ffn_norm = block.attention_norm.weight, block.ffn_norm.weight
        self.eps = block.attention_norm.eps
        self.n_heads = att.wq.out_features // att.head_dim
        self.n_kv_heads = att.wk.out_features // att.head_dim
        self.head_dim = att.head_dim
        self.qkv = _Linear.of([att.wq, att.wk, att.wv])
        self.gate_up = _Linear.of([ffn.w1, ffn.w3])
        self.wo = _Linear.of([att.wo])
        self.w2 = _Linear.of([ffn.w2])


def _attention(attend: Attend, layer_idx: int, qkv: torch.Tensor, st: StepTensors, cos: torch.Tensor,
               sin: torch.Tensor, pool: KVPool, b: _FusedBlock) -> torch.Tensor:
    """Rotary, KV-cache write and attention of one layer from its q|k|v rows; (T, hq, d)."""
    k_cache, v_cache = pool.layer(layer_idx)
    with_rotary = getattr(attend, "with_rotary", None) if FUSED_DECODE_ATTENTION else None
    if with_rotary is not None:
        return with_rotary(layer_idx, qkv, cos, sin, k_cache, v_cache, b.n_heads, b.n_kv_heads)
    q = rotary_kv_write(qkv, st.positions, cos, sin, k_cache, v_cache, st.slot_mapping, b.n_heads, b.n_kv_heads)
    return attend(layer_idx, q, k_cache, v_cache)


class FusedDecoder:
    """A fourfold Llama's paged-step forward over fused weights (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.blocks = [(int(name), _FusedBlock(block)) for name, block in model.layers.items()]
        self.int4_weight_only = all(
            lin.packed is not None and lin.packed.scheme.activation == "none"
            for _, b in self.blocks for lin in (b.qkv, b.wo, b.gate_up, b.w2))

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
        if INT4_FUSED_NORMS and self.int4_weight_only and self.blocks and self.blocks[0][1].qkv.packed.uses_gemv(x):
            return self._int4_decode(x, st, pool, attend)
        residual = None
        for layer_idx, b in self.blocks:
            normed, residual = add_rms_norm(x, residual, b.attn_norm, b.eps)
            qkv = b.qkv(normed)
            out = _attention(attend, layer_idx, qkv, st, cos, sin, pool, b)
            x = b.wo(out.reshape(out.shape[0], -1))
            normed, residual = add_rms_norm(x, residual, b.ffn_norm, b.eps)
            x = b.w2(b.gate_up(normed, gated=True))
        h = (x + residual)[st.logits_for]
        h, _ = add_rms_norm(h, None, m.norm.weight, m.norm.eps)
        head = m.output  # looked up per step: CPU runs may repack it (fourfold.infer.cpu_linear)
        return _Linear(head.weight, head.bias)(h) if type(head) is nn.Linear else head(h)

    def _int4_decode(self, h: torch.Tensor, st: StepTensors, pool: KVPool, attend: Attend) -> torch.Tensor:
        """The step of an int4 weight-only model through GEMVs that carry the norms and residual adds; h: embeddings."""
        m = self.model
        for layer_idx, b in self.blocks:
            qkv = b.qkv.packed.decode(h, norm_weight=b.attn_norm, eps=b.eps)
            out = _attention(attend, layer_idx, qkv, st, m.rope_cos, m.rope_sin, pool, b)
            h = b.wo.packed.decode(out.reshape(out.shape[0], -1), residual=h)
            act = b.gate_up.packed.decode(h, gated=True, norm_weight=b.ffn_norm, eps=b.eps)
            h = b.w2.packed.decode(act, residual=h)
        h, _ = add_rms_norm(h[st.logits_for], None, m.norm.weight, m.norm.eps)
        head = m.output
        return _Linear(head.weight, head.bias)(h) if type(head) is nn.Linear else head(h)
