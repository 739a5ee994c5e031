"""Fake quantization (fourfold.quant.fake_quant) and schemes: forward = quantize->dequantize, straight-through gradient, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fourfold.errors import ConfigError
from fourfold.quant.fake_quant import (FakeQuantLinear, dequantize_weight, fake_quantize, fake_quantize_activation,
                                       fake_quantize_weight, quantize_weight)
from fourfold.quant.schemes import PRESETS, QuantScheme, check_group_divides, scheme_by_name

NAMES = ["int8", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g256-asym", "8da4w-g32", "int4-g32-asym-fp32"]


@pytest.mark.parametrize("name", NAMES)
def test_forward_equals_quantize_dequantize(name):
    scheme = scheme_by_name(name)
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scales, zeros = quantize_weight(w, scheme)
    assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax
    assert scales.dtype == scheme.torch_scale_dtype
    # 4 bits can hold only 16 values per group: the quantized weight really is on the grid
    assert len(torch.unique(q)) <= 2 ** scheme.weight_bits
    expected = dequantize_weight(q, scales, zeros, scheme)
    assert torch.equal(fake_quantize_weight(w, scheme), expected)
    # and it is close to w: half a step per element, a little more where an asymmetric group's extreme
    # value clips after its scale was rounded to bf16 (up to (qmax - qmin + 1) bf16 half-ulps of a step)
    step = scales.float().repeat_interleave(w.shape[1] // scales.shape[1], dim=1)
    slack = (scheme.qmax - scheme.qmin + 1) * 2.0 ** -8 if not scheme.symmetric and scheme.scale_dtype == "bfloat16" else 0
    assert ((expected - w).abs() <= step * (0.5 + slack) + 1e-7).all()


def test_asymmetric_uses_zero_points_and_full_range():
    w = torch.rand(16, 64) + 0.1          # all positive: symmetric wastes half its grid
    sym, asym = scheme_by_name("int4-g64"), scheme_by_name("int4-g64-asym")
    _, _, zeros = quantize_weight(w, asym)
    assert (zeros == asym.qmin).all()     # lo widened to 0 maps to qmin
    err = lambda s: (fake_quantize_weight(w, s) - w).abs().mean()
    assert err(asym) < err(sym)


def test_gradient_is_straight_through_inside_zero_outside():
    scale, zero = torch.tensor(0.5), torch.tensor(0.0)
    # int4 signed range [-8, 7] * 0.5 = [-4, 3.5]; +/-3.74 rounds inside, 3.76 and -4.3 clip
    x = torch.tensor([-10.0, -4.3, -3.74, -1.1, 0.0, 0.26, 3.5, 3.74, 3.76, 9.0], requires_grad=True)
    y = fake_quantize(x, scale, zero, -8, 7)
    assert torch.equal(y.detach(), torch.tensor([-4.0, -4.0, -3.5, -1.0, 0.0, 0.5, 3.5, 3.5, 3.5, 3.5]))
    upstream = torch.arange(1.0, 11.0)
    y.backward(upstream)
    inside = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.float32)
    assert torch.equal(x.grad, upstream * inside)


def test_weight_and_activation_gradients_identity_with_on_the_fly_scales():
    w = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 64)
    fake_quantize_weight(w, scheme_by_name("int4-g32-fp32")).backward(g)
    assert torch.equal(w.grad, g)          # min/max scales never clip with fp32 scales
    x = torch.randn(3, 5, 64, requires_grad=True)
    out = fake_quantize_activation(x)
    assert not torch.equal(out, x) and (out - x).abs().max() < x.abs().max() / 100
    out.backward(torch.ones_like(x))
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("name", ["int4-g32", "8da4w-g64", "int8"])
def test_fake_quant_linear_keeps_names_and_trains(name):
    torch.manual_seed(0)
    lin = nn.Linear(128, 32)
    fq = FakeQuantLinear.from_linear(lin, scheme_by_name(name), "blocks.0.wq")
    assert [n for n, _ in fq.named_parameters()] == ["weight", "bias"]
    assert fq.weight is lin.weight and set(fq.state_dict()) == {"weight", "bias"}
    x = torch.randn(4, 128)
    y = fq(x)
    assert not torch.allclose(y, lin(x), atol=1e-6)   # the rounding is really in the forward
    xq = fake_quantize_activation(x) if name.startswith("8da") else x
    ref = xq @ fake_quantize_weight(lin.weight, fq.scheme).T + lin.bias
    assert torch.allclose(y, ref, atol=1e-6)
    y.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_unknown_scheme_lists_valid_names_and_closest():
    with pytest.raises(ConfigError, match="Did you mean 'int4-g128'") as info:
        scheme_by_name("int4-g182")
    assert "int8" in str(info.value) and "8da4w-g256" in str(info.value)
    assert {"int8", "int4-g32", "int4-g256-asym", "8da4w-g32", "8da4w-g256"} <= set(PRESETS)


def test_group_size_must_divide_input_dim():
    with pytest.raises(ConfigError, match=r"'layers.3.ffn.w2' has 96 input features.*group size 32"):
        check_group_divides(scheme_by_name("int4-g64"), "layers.3.ffn.w2", 96)
    with pytest.raises(ConfigError, match="layers.0.wq"):
        FakeQuantLinear.from_linear(nn.Linear(100, 16), scheme_by_name("int4-g32"), "layers.0.wq")
    check_group_divides(scheme_by_name("int4-g64"), "ok", 128)
    check_group_divides(scheme_by_name("int8"), "ok", 100)


@pytest.mark.parametrize("kwargs", [dict(weight_bits=3), dict(group_size=48), dict(weight_bits=8, group_size=32),
                                    dict(weight_bits=8, group_size=None, symmetric=False),
                                    dict(scale_dtype="float16"), dict(activation="int8")])
def test_invalid_schemes_rejected(kwargs):
    with pytest.raises(ConfigError):
        QuantScheme(**kwargs)
