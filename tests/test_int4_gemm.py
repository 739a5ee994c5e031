"""The Triton int4 GEMM (fourfold.quant.int4_gemm) against a float64 matmul of the dequantized weights, and against
Int4WeightLinear's own CPU path on a converted layer.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported);
small shapes keep the numpy interpreter fast. bench/int4_gemm_check.py checks the real shapes on a GPU.
"""

import os

import pytest
import torch

from fourfold.quant import int4_gemm
from fourfold.quant.fake_quant import fake_quantize_activation
from fourfold.quant.packing import Int4WeightLinear, pack_int4, unpack_int4
from fourfold.quant.schemes import scheme_by_name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    int4_gemm.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported)")


def _weights(n: int, k: int, group: int, symmetric: bool, seed: int):
    """Random int4 values, scales, zero points; their float64 dequantized matrix (q - z) * s."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) + 0.1
    if symmetric:
        zeros = torch.zeros(n, k // group, dtype=torch.int8)
    else:
        zeros = torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8)
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return pack_int4(q + 8), scales, zeros, w


@pytest.mark.parametrize("method", ["fused", "dequant"])
@pytest.mark.parametrize("rows,n,k,group,config,symmetric,bias", [
    (5, 40, 128, 64, (16, 16, 64, 4, 1), True, False),     # M < BLOCK_M; N = 40: the last N tile is masked
    (37, 24, 96, 32, (16, 16, 32, 4, 2), False, True),     # M not a multiple of BLOCK_M (3 M tiles), 3 groups
    (20, 48, 256, 128, (16, 32, 64, 4, 1), False, False),  # 2 k-steps per group, N tile half masked
    (3, 16, 64, 32, None, True, True),                     # the default config choice
    (70, 48, 256, 128, None, False, True),                 # ... at 65-128 rows: W_LEFT, 64 x 64 tiles, split-K
    (20, 48, 256, 128, (16, 32, 64, 4, 1, 2), False, True),  # split-K: 2 splits of 2 k-steps, bias in the sum
    (5, 40, 96, 32, (16, 16, 32, 4, 1, 4), True, False),   # split 4 asked over 3 k-steps: 3 splits of one
    (37, 40, 96, 32, (16, 32, 32, 4, 1, 1, 1), False, True),  # the weight tile as the dot's left operand
    (20, 48, 256, 128, (32, 16, 64, 4, 1, 2, 1), True, False),  # ... with split-K, N masked, M tile half empty
])
def test_int4_gemm_matches_dequantized_float64(rows, n, k, group, config, symmetric, bias, method):
    packed, scales, zeros, w = _weights(n, k, group, symmetric, seed=rows + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    b = torch.randn(n) if bias else None
    want = x.double() @ w.T + (b.double() if bias else 0)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, packed, scales, zeros, b)]
    y = int4_gemm.int4_gemm(dev[0], dev[1], dev[2], dev[3], group, dev[4], asym=not symmetric, config=config,
                            method=method)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double().cpu(), want, rtol=1e-5, atol=1e-3)


def test_int4_gemm_keeps_leading_dims_and_uses_zero_points_only_when_asked():
    packed, scales, zeros, w = _weights(32, 64, 32, symmetric=False, seed=3)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    cfg = (16, 16, 32, 4, 1)
    y = int4_gemm.int4_gemm(x.to(DEVICE), packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32, config=cfg)
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y.double().cpu(), x.double() @ w.T, rtol=1e-5, atol=1e-3)
    no_zero = int4_gemm.int4_gemm(x.to(DEVICE), packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32,
                                  asym=False, config=cfg)
    assert (no_zero.cpu() - y.cpu()).abs().max() > 1e-2   # the zero points above are not all zero


@pytest.mark.parametrize("scheme_name", ["int4-g32", "int4-g32-asym", "8da4w-g32"])
def test_int4_gemm_on_a_converted_linear_matches_its_cpu_forward(scheme_name):
    torch.manual_seed(0)
    scheme = scheme_by_name(scheme_name)
    module = Int4WeightLinear.from_float(torch.nn.Linear(64, 32, bias=True), scheme, "lin")
    x = torch.randn(19, 64)
    want = module(x)   # torch's CPU int4 kernel (8da4w: after the activation fake-quant)
    xq = fake_quantize_activation(x) if scheme.activation != "none" else x
    args = [t.to(DEVICE) for t in (xq, module.weight_int4, module.scales, module.zero_points, module.bias)]
    y = int4_gemm.int4_gemm(*args[:4], 32, args[4], asym=not scheme.symmetric, config=(16, 16, 32, 4, 1))
    torch.testing.assert_close(y.cpu(), want, rtol=1e-4, atol=1e-4)


def test_the_module_dispatches_by_rows_on_cuda_only():
    module = Int4WeightLinear.from_float(torch.nn.Linear(64, 32), scheme_by_name("int4-g32"), "lin")
    assert not module.uses_gemm(torch.randn(64, 64))     # CPU tensors keep torch's CPU kernel
    if torch.cuda.is_available():
        cuda_x = torch.randn(int4_gemm.TINYGEMM_ROWS + 1, 64, device="cuda")
        assert module.uses_gemm(cuda_x) and not module.uses_gemm(cuda_x[:int4_gemm.TINYGEMM_ROWS])


def test_int4_gemm_dequantizes_whole_weights_above_dequant_rows(monkeypatch):
    packed, scales, zeros, w = _weights(16, 64, 32, symmetric=False, seed=5)
    calls = []
    real = int4_gemm.dequantize_int4
    monkeypatch.setattr(int4_gemm, "dequantize_int4", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(int4_gemm, "DEQUANT_ROWS", 4)
    dev = [t.to(DEVICE) for t in (packed, scales, zeros)]
    for rows, dequantized in ((4, 0), (5, 1)):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        y = int4_gemm.int4_gemm(x.to(DEVICE), *dev, 32, config=(16, 16, 32, 4, 1))
        assert len(calls) == dequantized
        torch.testing.assert_close(y.double().cpu(), x.double() @ w.T, rtol=1e-5, atol=1e-3)


def test_float32_dots_follow_torch_float32_matmul_precision():
    """float32 activations get full float32 dots unless torch allows TF32 for its own float32 matmuls (on a GPU
    the tests above then hold their float32 tolerances; TF32 misses them by ~0.1)."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert int4_gemm.dot_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert int4_gemm.dot_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def _bf16_case(symmetric: bool):
    """Packed weights with bf16 scales, and their weights ((q - z) * s in float32) rounded to bf16."""
    packed, scales, zeros, _ = _weights(48, 256, 64, symmetric, seed=11)
    scales = scales.to(torch.bfloat16)
    q = unpack_int4(packed).to(torch.int32) - 8
    z = zeros.to(torch.int32).repeat_interleave(64, 1) if not symmetric else 0
    want = ((q - z).float() * scales.float().repeat_interleave(64, 1)).to(torch.bfloat16)
    return [t.to(DEVICE) for t in (packed, scales, zeros)], want


@pytest.mark.parametrize("symmetric", [True, False])
def test_bf16_scales_dequantize_to_the_bits_of_the_float32_formula(symmetric):
    """On a GPU this checks the conversion-free path (a nibble OR-ed into bf16 128's bits) bit for bit; the
    interpreter runs the float32 one."""
    dev, want = _bf16_case(symmetric)
    w = int4_gemm.dequantize_int4(*dev, 64, torch.bfloat16, asym=not symmetric)
    if DEVICE == "cuda":
        assert torch.equal(w.cpu(), want)
    else:   # the interpreter truncates float32 to bf16 instead of rounding: one bf16 step apart at most
        torch.testing.assert_close(w.float(), want.float(), rtol=2 ** -7, atol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's dots of bf16 tiles are wrong (float32 ones are right)")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("config", [(16, 16, 64, 4, 1), (32, 16, 64, 4, 1, 2, 1), (64, 64, 64, 4, 3, 1, 1)])
def test_bf16_fused_gemm_uses_the_same_weights(symmetric, config):
    dev, want = _bf16_case(symmetric)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    y = int4_gemm.int4_gemm(x.to(DEVICE), *dev, 64, asym=not symmetric, config=config)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double().cpu(), x.double() @ want.double().T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("method", ["fused", "dequant"])
@pytest.mark.parametrize("rows,n,k,group,config", [
    (5, 48, 128, 64, (16, 16, 64, 4, 1)),              # 3 N tiles, 2 k-steps, one group each
    (20, 48, 256, 128, (16, 32, 64, 4, 1, 2)),         # N tile half past the last 16-row block, split-K
    (37, 32, 256, 128, (32, 32, 128, 4, 1, 1, 1)),     # W_LEFT, BLOCK_K of two 64-wide quads
    (70, 64, 256, 64, None),                           # the default choice at 65-128 rows
])
def test_gemm_on_the_words_equals_the_stored_layout(rows, n, k, group, config, method):
    """int4_gemm (and dequantize_int4) on fourfold.quant.int4_mma's words build the same weights as on the stored
    nibbles (the GEMM as two half tiles, so its sums may be grouped differently on a GPU)."""
    from fourfold.quant import int4_mma

    packed, scales, zeros, _ = _weights(n, k, group, symmetric=False, seed=rows + k)
    words = int4_mma.repack_mma(packed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    dev = [t.to(DEVICE) for t in (x, packed, scales, zeros, words, torch.randn(n))]
    want = int4_gemm.int4_gemm(*dev[:4], group, dev[5], config=config, method=method)
    got = int4_gemm.int4_gemm(dev[0], dev[4], dev[2], dev[3], group, dev[5], config=config, method=method, words=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    w = int4_gemm.dequantize_int4(dev[4], dev[2], dev[3], group, torch.float32, words=True)
    assert torch.equal(w, int4_gemm.dequantize_int4(*dev[1:4], group, torch.float32))
