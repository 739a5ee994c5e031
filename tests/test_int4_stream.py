"""The streaming one-row int4 GEMV (fourfold.quant.int4_stream): its launch rules on CPU, its cubin where NVRTC is,
and on a GPU the same output as int4_mma_gemv bit for bit (same warps), through Int4WeightLinear.decode too."""

import pytest
import torch

from fourfold.ops import nvrtc_launch
from fourfold.quant import int4_mma, int4_stream
from fourfold.quant.fake_quant import dequantize_weight, quantize_weight
from fourfold.quant.packing import Int4WeightLinear
from fourfold.quant.schemes import scheme_by_name

GPU = torch.cuda.is_available() and nvrtc_launch.available()


def test_stream_config_fills_the_ring_and_splits_k_like_int4_mma():
    # 64 KiB a block: 16 warps x 8 quads of 512 bytes, half as many quads when gate and up stream together
    assert int4_stream.stream_config(4096, 128) == (16, 8, 4)
    assert int4_stream.stream_config(4096, 128, gated=True) == (16, 4, 4)
    assert int4_stream.stream_config(14336, 128) == (16, 8, 14)
    # the warps' K shares are int4_mma's with the same warps and no split, which makes the sums the same
    for k, group, gated in ((4096, 128, False), (14336, 128, False), (2048, 32, True), (1024, 256, True)):
        warps, _, maxq = int4_stream.stream_config(k, group, gated)
        assert int4_mma.config(k, group, gated, warps=warps, split=1) == (warps, maxq, 1)
    assert int4_stream.stream_config(4096, 128, warps=8, ring=16) == (8, 16, 8)


@pytest.mark.parametrize("kwargs", [dict(warps=17), dict(warps=0), dict(ring=3), dict(ring=0)])
def test_stream_config_rejects_what_the_kernel_cannot_take(kwargs):
    with pytest.raises(ValueError, match="warps a block|power of two"):
        int4_stream.stream_config(4096, 128, **kwargs)


def test_shared_bytes_count_the_rings_and_x():
    assert int4_stream.shared_bytes(16, 8, 4096, False) == 16 * 8 * 512 + 4096 * 2
    assert int4_stream.shared_bytes(16, 4, 4096, True) == 16 * 4 * 1024 + 4096 * 2


def test_use_stream_takes_one_row_on_wide_weights(monkeypatch):
    monkeypatch.setattr(int4_stream, "MODE", "auto")
    assert int4_stream.use_stream(28672, 4096, 1) and int4_stream.use_stream(4096, 14336, 1)
    assert not int4_stream.use_stream(28672, 4096, 2)        # 2-8 rows: the staged int4_mma kernel
    assert not int4_stream.use_stream(11264, 2048, 1)        # llama-1b: its kernels are faster there
    monkeypatch.setattr(int4_stream, "MODE", "0")
    assert not int4_stream.use_stream(28672, 4096, 1)
    monkeypatch.setattr(int4_stream, "MODE", "1")
    assert int4_stream.use_stream(2560, 2048, 1) and not int4_stream.use_stream(2560, 2048, 3)


@pytest.mark.skipif(not nvrtc_launch.available(), reason="needs cuda-bindings (NVRTC)")
@pytest.mark.parametrize("gated,norm", [(True, True), (False, False)])
def test_kernel_compiles_for_hopper_without_a_gpu(gated, norm):
    defines = {"WARPS": 16, "RING": 8, "MAXQ": 14, "GS": 8, "GATED": int(gated), "NORM": int(norm), "RES": 1,
               "BIAS": 1, "PDL": 1}
    try:
        cubin = nvrtc_launch.compile_cubin(int4_stream._source(), "int4_stream_gemv", defines, "sm_90")
    except Exception as e:  # noqa: BLE001 - cuda-bindings without the NVRTC library
        pytest.skip(f"NVRTC unavailable: {e}")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(not GPU, reason="needs CUDA + cuda-bindings")
@pytest.mark.parametrize("form", ["plain", "residual", "norm", "gated_norm", "bias"])
@pytest.mark.parametrize("grid", [None, 3])
def test_kernel_equals_int4_mma_bit_for_bit_on_gpu(form, grid):
    torch.manual_seed(3)
    scheme = scheme_by_name("int4-g64-asym" if form == "bias" else "int4-g128")
    n, k = (1024, 2048) if form.startswith("gated") else (768, 1536)
    lin = torch.nn.Linear(k, n, bias=form == "bias", device="cuda", dtype=torch.bfloat16)
    mod = Int4WeightLinear.from_float(lin, scheme).cuda()
    gated = form.startswith("gated")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kw = dict(bias=mod.bias, gated=gated,
              residual=torch.randn(1, n, device="cuda", dtype=torch.bfloat16) if form == "residual" else None,
              norm_weight=(torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16) if form.endswith("norm") else None)
    g = scheme.group_size
    cfg = int4_stream.stream_config(k, g, gated, ring=2)   # a short ring: slots are reused many times
    y = int4_stream.int4_stream_gemv(x, *mod.mma_words(), g, launch_config=cfg, grid=grid, **kw)
    base = int4_mma.int4_mma_gemv(x, *mod.mma_words(), g, launch_config=int4_mma.config(k, g, gated, warps=cfg[0],
                                                                                         split=1), **kw)
    assert torch.equal(y, base)
    if form == "plain":
        q, s, z = quantize_weight(lin.weight, scheme)
        ref = x.float() @ dequantize_weight(q, s, z, scheme).float().T
        assert (y.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.skipif(not GPU, reason="needs CUDA + cuda-bindings")
def test_decode_streams_one_row_when_asked(monkeypatch):
    torch.manual_seed(4)
    scheme = scheme_by_name("int4-g128")
    lin = torch.nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = Int4WeightLinear.from_float(lin, scheme).cuda()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(int4_stream, "MODE", "1")
    y = mod.decode(x, residual=r)
    expected = int4_stream.int4_stream_gemv(x, *mod.mma_words(), 128, residual=r)
    assert torch.equal(y, expected)
    q, s, z = quantize_weight(lin.weight, scheme)
    ref = x.float() @ dequantize_weight(q, s, z, scheme).float().T + r.float()
    assert (y.float() - ref).norm() / ref.norm() < 1e-2
