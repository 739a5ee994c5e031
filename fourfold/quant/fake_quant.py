"""Fake quantization for quantization-aware training: quantize then dequantize in the forward, straight-through backward.

    q, scales, zero_points = quantize_weight(w, scheme)      # ints in [qmin, qmax], one scale per group
    w_hat = dequantize_weight(q, scales, zero_points, scheme)
    fake_quantize_weight(w, scheme)                           # == w_hat in forward, differentiable
    FakeQuantLinear.from_linear(linear, scheme, name)         # drop-in nn.Linear; same 'weight'/'bias' names

Scales are computed on the fly: every forward derives each group's scale (and zero point) from the
current weights (max|w| for symmetric, [min, max] widened to include 0 for asymmetric), rounds it to
the scheme's scale dtype and treats it as a constant (no gradient flows into it). Nothing is learned,
so a QAT checkpoint holds only the ordinary float weights, and conversion (packing.py) recomputes the
very same scales from them.

Estimator: straight-through with clipping. The backward passes the incoming gradient unchanged where
round(w / scale) + zero_point lies inside [qmin, qmax], and zero where the clamp to that range changed
the value (the forward is flat there). With on-the-fly min/max scales nothing clips except, rarely, the
group's extreme value after the scale was rounded down to bf16; `fake_quantize` with given scales
(as the tests use) shows the clipping branch.

Plain torch, not torchao: torchao's QAT API runs on CPU, but its int4 weight-only kernels need a package
(mslk) that does not install, and these primitives are a few lines each, so fake quant and conversion
share one definition of the numbers here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fourfold.quant.schemes import QuantScheme, check_group_divides

ACT_QMIN, ACT_QMAX = -128, 127
_EPS = 1e-9     # smallest scale: an all-zero group quantizes to zeros instead of dividing by 0


def _groups(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[N, K] -> [N, K // group_size, group_size] (per-channel: [N, 1, K]), as float32."""
    n, k = w.shape
    return w.float().reshape(n, 1 if group_size is None else k // group_size, -1)


def _round_clamp(x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, qmin: int, qmax: int):
    """(unclamped rounded ints, clamped ints) of x / scales + zero_points, in float32."""
    raw = torch.round(x / scales) + zero_points
    return raw, raw.clamp(qmin, qmax)


def weight_qparams(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scales in the scheme's scale dtype, integer zero points as int8), both [N, groups]."""
    g = _groups(w.detach(), scheme.group_size)
    if scheme.symmetric:
        scales = g.abs().amax(-1) / scheme.qmax
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = (hi - lo) / (scheme.qmax - scheme.qmin)
    scales = scales.clamp(min=_EPS).to(scheme.torch_scale_dtype)
    if scheme.symmetric:
        zeros = torch.zeros_like(scales, dtype=torch.int8)
    else:
        zeros = torch.round(scheme.qmin - lo / scales.float()).clamp(scheme.qmin, scheme.qmax).to(torch.int8)
    return scales, zeros


def quantize_weight(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ints [N, K] int8 in [qmin, qmax], scales [N, groups], zero points [N, groups] int8) for a weight [N, K]."""
    scales, zeros = weight_qparams(w, scheme)
    _, q = _round_clamp(_groups(w.detach(), scheme.group_size), scales.float()[..., None],
                        zeros.float()[..., None], scheme.qmin, scheme.qmax)
    return q.reshape(w.shape).to(torch.int8), scales, zeros


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, scheme: QuantScheme,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero_point) * scale per group, computed in float32 and returned as `dtype`."""
    g = _groups(q, scheme.group_size)
    w = (g - zero_points.float()[..., None]) * scales.float()[..., None]
    return w.reshape(q.shape).to(dtype)


class _FakeQuant(torch.autograd.Function):
    """Forward (clamp(round(x / s) + z) - z) * s; backward the gradient where no clamping happened, else 0."""

    @staticmethod
    def forward(ctx, x, scales, zero_points, qmin, qmax):
        raw, q = _round_clamp(x.float(), scales.float(), zero_points.float(), qmin, qmax)
        ctx.save_for_backward((raw >= qmin) & (raw <= qmax))
        return ((q - zero_points.float()) * scales.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None, None


def fake_quantize(x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, qmin: int, qmax: int):
    """Quantize-dequantize x with given scales/zero points (broadcast against x); straight-through gradient."""
    return _FakeQuant.apply(x, scales.detach(), zero_points.detach(), qmin, qmax)


def fake_quantize_weight(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """dequantize_weight(*quantize_weight(w)) in the forward, straight-through to w in the backward."""
    scales, zeros = weight_qparams(w, scheme)
    n, k = w.shape
    grouped = w.reshape(n, 1 if scheme.group_size is None else k // scheme.group_size, -1)
    out = fake_quantize(grouped, scales[..., None], zeros[..., None], scheme.qmin, scheme.qmax)
    return out.reshape(n, k)


def fake_quantize_weight_sharded(w: torch.Tensor, scheme: QuantScheme, name: str = "linear") -> torch.Tensor:
    """fake_quantize_weight of a plain weight, or of each tensor-parallel shard of a DTensor weight, in place.

    Groups run along in_features (dim 1), so a shard's group-wise scales equal the unsharded weight's as
    long as no group straddles a shard boundary: true for column-parallel (Shard(0)) and for the vocab-split
    embedding; a row-parallel shard (Shard(1)) must hold whole groups, else ConfigError. The quantization
    runs on the local shard (no communication) and the result is rewrapped with the same placements.
    """
    if not isinstance(w, DTensor):
        return fake_quantize_weight(w, scheme)
    local = w.to_local()
    check_group_divides(scheme, f"{name} (its tensor-parallel shard)", local.shape[1])
    out = fake_quantize_weight(local, scheme)
    return DTensor.from_local(out, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def activation_qparams(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (last dim) asymmetric int8 (scales float32, zero points as float32 ints), shaped [..., 1]."""
    xf = x.detach().float()
    lo, hi = xf.amin(-1, keepdim=True).clamp(max=0), xf.amax(-1, keepdim=True).clamp(min=0)
    scales = ((hi - lo) / (ACT_QMAX - ACT_QMIN)).clamp(min=_EPS)
    zeros = torch.round(ACT_QMIN - lo / scales).clamp(ACT_QMIN, ACT_QMAX)
    return scales, zeros


def fake_quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token int8 quantize-dequantize (the '8da' of 8da4w), scales from this x, straight-through."""
    scales, zeros = activation_qparams(x)
    return fake_quantize(x, scales, zeros, ACT_QMIN, ACT_QMAX)


class FakeQuantLinear(nn.Linear):
    """nn.Linear whose forward uses the fake-quantized weight (and input, for 8da4w); parameters 'weight', 'bias'."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, scheme: QuantScheme,
                 device=None, dtype=None, name: str = "linear") -> None:
        check_group_divides(scheme, name, in_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.scheme, self.layer_name = scheme, name

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme, name: str = "linear") -> "FakeQuantLinear":
        """A FakeQuantLinear sharing `linear`'s parameter tensors (no copy), so optimizer and checkpoints see the same."""
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, scheme=scheme,
                  device="meta", name=name)
        out.weight, out.bias = linear.weight, linear.bias
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activation != "none":
            x = fake_quantize_activation(x)
        return F.linear(x, fake_quantize_weight_sharded(self.weight, self.scheme, self.layer_name), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scheme={self.scheme.name}"
