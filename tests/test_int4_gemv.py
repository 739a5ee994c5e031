"""The int4 decode GEMV (fourfold.quant.int4_gemv): its group-plane repacking round-trips exactly, and the kernel
(plain, gated SiLU*mul, residual add; symmetric and asymmetric; groups 32..256) equals a float64 matmul of the
dequantized weights. Without a GPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it);
bench/int4_gemv_check.py checks the real shapes and times them on a GPU.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from fourfold.quant import int4_gemv
from fourfold.quant.packing import Int4WeightLinear, pack_int4, unpack_int4
from fourfold.quant.schemes import scheme_by_name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    int4_gemv.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported)")


@pytest.mark.parametrize("group", [8, 32, 64, 128, 256])
def test_repack_planes_round_trips_and_places_each_group_in_its_words(group):
    g = torch.Generator().manual_seed(group)
    n, k = 6, 512
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    words = int4_gemv.repack_planes(pack_int4(u), group)
    assert words.dtype == torch.int32 and words.shape == (n, k // 8)
    assert torch.equal(int4_gemv.unpack_planes(words, group), u)
    # word c of group t, nibble i, holds element t * group + i * group / 8 + c
    t, c, i = 1 % (k // group), 3 % (group // 8), 5
    word = int(words[2, t * (group // 8) + c]) & 0xFFFFFFFF
    assert (word >> (4 * i)) & 0xF == int(u[2, t * group + i * (group // 8) + c])


def test_repack_planes_rejects_groups_that_do_not_fit():
    with pytest.raises(ValueError, match="group size"):
        int4_gemv.repack_planes(torch.zeros(2, 48, dtype=torch.uint8), 64)


def _case(n: int, k: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) + 0.1
    zeros = (torch.zeros(n, k // group, dtype=torch.int8) if symmetric
             else torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8))
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return pack_int4(q + 8), scales, zeros, w


@needs_kernels
@pytest.mark.parametrize("rows,n,k,group,config,symmetric,gated,bias,residual", [
    (1, 24, 128, 32, (8, 64, 4), True, False, True, False),     # 2 chunks, last row tile masked (24 = 3 x 8)
    (2, 16, 192, 64, (4, 64, 2), False, True, False, False),    # gated, 3 chunks, zero points
    (3, 20, 256, 128, (8, 128, 4), False, False, True, True),   # residual add, N tile masked
    (1, 16, 512, 256, None, True, True, True, True),            # the default config, group 256
    (2, 24, 320, 64, (8, 256, 1), False, True, True, True),     # K = 320: the second chunk is cut at K
])
def test_int4_gemv_matches_dequantized_float64(rows, n, k, group, config, symmetric, gated, bias, residual):
    n_total = 2 * n if gated else n
    packed, scales, zeros, w = _case(n_total, k, group, symmetric, seed=rows + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    b = torch.randn(n_total) if bias else None
    r = torch.randn(rows, n) if residual else None
    y64 = x.double() @ w.T + (b.double() if bias else 0)
    want = F.silu(y64[:, :n]) * y64[:, n:] if gated else y64
    if residual:
        want = want + r.double()
    dev = [t.to(DEVICE) if t is not None else None for t in (x, packed, scales, zeros, b, r)]
    words = int4_gemv.repack_planes(dev[1], group)
    y = int4_gemv.int4_gemv(dev[0], dev[1], dev[2], dev[3], group, dev[4], gated=gated, config=config,
                            asym=not symmetric, words=words, residual=dev[5])
    assert y.shape == (rows, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double().cpu(), want, rtol=1e-4, atol=1e-3)


@needs_kernels
def test_int4_gemv_without_zero_points_ignores_them_only_when_told():
    packed, scales, zeros, w = _case(16, 64, 32, symmetric=False, seed=7)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(8))
    dev = [t.to(DEVICE) for t in (x, packed, scales, zeros)]
    with_z = int4_gemv.int4_gemv(*dev, 32, config=(8, 64, 4))
    without = int4_gemv.int4_gemv(*dev, 32, config=(8, 64, 4), asym=False)
    torch.testing.assert_close(with_z.double().cpu(), x.double() @ w.T, rtol=1e-5, atol=1e-3)
    assert not torch.allclose(with_z, without)


@needs_kernels
@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors through the Triton interpreter; on a GPU machine Triton "
                    "runs CUDA and cannot take them")
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64-asym"])
def test_module_gemv_path_equals_its_cpu_kernel_path(scheme, monkeypatch):
    """Int4WeightLinear routed through the GEMV (its cached repacked words) equals torch's int4 kernel."""
    torch.manual_seed(0)
    lin = Int4WeightLinear.from_float(torch.nn.Linear(128, 32, bias=True), scheme_by_name(scheme))
    x = torch.randn(2, 128)
    want = lin(x)                                   # CPU: torch's _weight_int4pack_mm_for_cpu
    monkeypatch.setattr(Int4WeightLinear, "uses_gemv", lambda self, x: True)
    got = lin(x)
    got_again = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got, got_again) and len(lin._planes_cache) == 1
    assert torch.equal(int4_gemv.unpack_planes(next(iter(lin._planes_cache.values())), 32 if "32" in scheme else 64),
                       unpack_int4(lin.weight_int4))


@needs_kernels
@pytest.mark.parametrize("gated,chunk", [(False, 64), (True, 64), (True, 128)])
def test_int4_gemv_with_rms_norm_fused_equals_norm_then_matmul(gated, chunk):
    n, k, group = 16, 192, 32      # chunk 128: the last chunk is cut at K (masked loads of x and norm weight)
    n_total = 2 * n if gated else n
    packed, scales, zeros, w = _case(n_total, k, group, symmetric=True, seed=11)
    g = torch.Generator().manual_seed(12)
    h, nw = torch.randn(2, k, generator=g) * 3, torch.rand(k, generator=g) + 0.5
    normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    y64 = normed @ w.T
    want = F.silu(y64[:, :n]) * y64[:, n:] if gated else y64
    dev = [t.to(DEVICE) for t in (h, packed, scales, zeros, nw)]
    y = int4_gemv.int4_gemv(dev[0], dev[1], dev[2], dev[3], group, gated=gated, config=(8, chunk, 4), asym=False,
                            norm_weight=dev[4], eps=1e-5)
    torch.testing.assert_close(y.double().cpu(), want, rtol=1e-4, atol=1e-3)


