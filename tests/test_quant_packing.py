"""Real low-bit linears (fourfold.quant.packing): exact int4 packing, torch's CPU kernels match the fake-quant linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fourfold.errors import ConfigError
from fourfold.quant.fake_quant import FakeQuantLinear, quantize_weight
from fourfold.quant.packing import Int4WeightLinear, Int8WeightLinear, pack_int4, unpack_int4
from fourfold.quant.schemes import scheme_by_name


def test_int4_pack_unpack_round_trips_exactly():
    u = torch.randint(0, 16, (48, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    u[0, :16] = torch.arange(16, dtype=torch.uint8)   # every nibble value appears
    p = pack_int4(u)
    assert p.shape == (48, 128) and p.dtype == torch.uint8
    assert torch.equal(unpack_int4(p), u)
    assert int(p[0, 0]) == 0x01 and int(p[0, 7]) == 0xEF     # element 2j is the high nibble


def _pair(name, dtype, n=64, k=256, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(dtype)
    scheme = scheme_by_name(name)
    fq = FakeQuantLinear.from_linear(lin, scheme, "layer")
    conv = (Int8WeightLinear if scheme.weight_bits == 8 else Int4WeightLinear).from_float(lin, scheme, "layer")
    return fq, conv


# Tolerances, relative to max |output|: fp32 kernels agree to float32 accumulation order (1e-5);
# bf16 kernels round the output (and the float zero -z*s) to bf16's 8-bit mantissa (1e-2).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4-g32", "int4-g64-asym", "int4-g128-fp32", "int4-g256-asym", "8da4w-g32",
                                  "int8", "int8-fp32"])
def test_converted_matches_fake_quant(name, dtype):
    fq, conv = _pair(name, dtype)
    x = torch.randn(2, 7, 256).to(dtype)
    with torch.no_grad():
        ref, out = fq(x).float(), conv(x)
    assert out.dtype == dtype and out.shape == (2, 7, 64)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], f"{name} {dtype}: relative error {err}"


def test_converted_int4_really_uses_the_grid_and_stores_quarter_bytes():
    fq, conv = _pair("int4-g128", torch.bfloat16, bias=False)
    q, _, _ = quantize_weight(fq.weight, fq.scheme)
    assert torch.equal(unpack_int4(conv.weight_int4).to(torch.int16) - 8, q.to(torch.int16))
    assert set(conv.state_dict()) == {"weight_int4", "scales", "zero_points"}
    bf16_bytes = fq.weight.numel() * 2
    stored = sum(t.numel() * t.element_size() for t in conv.state_dict().values())
    assert conv.weight_int4.numel() * conv.weight_int4.element_size() == bf16_bytes // 4
    assert stored < bf16_bytes * 0.3


def test_conversion_errors():
    with pytest.raises(ConfigError, match="multiple of 16"):
        Int4WeightLinear.from_float(nn.Linear(64, 24), scheme_by_name("int4-g32"), "head")
    with pytest.raises(ConfigError, match="'head'.*60 input features"):
        Int4WeightLinear.from_float(nn.Linear(60, 32), scheme_by_name("int4-g32"), "head")
    with pytest.raises(ConfigError, match="8-bit"):
        Int4WeightLinear.from_float(nn.Linear(64, 32), scheme_by_name("int8"), "head")
