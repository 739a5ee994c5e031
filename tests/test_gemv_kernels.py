"""The bf16 decode GEMV (fourfold.infer.gemv_gpu; int4: tests/test_int4_gemv.py) against a float64 reference, and the
fused decoder over a converted int4 model against the model's own forward.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is
imported); small shapes keep the numpy interpreter fast. bench/gemv_check.py checks the real shapes on a GPU.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from fourfold.infer import gemv_gpu
from fourfold.infer.fused_decoder import FusedDecoder, can_fuse
from fourfold.quant.qat import ptq
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from tests.engine_helpers import tiny_model
from tests.test_engine_fused import PROMPTS, _steps_match

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    gemv_gpu.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported)")


def _runner(model, fuse: bool, device: str = "cpu") -> ModelRunner:
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, 32, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, torch.device(device))
    return ModelRunner(model.to(device), pool, torch.device(device), fuse=fuse)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gated: bool) -> torch.Tensor:
    y = x.double() @ w.double().T + b.double()
    if gated:
        half = y.shape[-1] // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    return y


@needs_kernels
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,k,block_k", [(1, 96, 64), (3, 128, 128)])
def test_bf16_gemv_matches_float64(gated, rows, k, block_k):
    torch.manual_seed(rows + k)
    n = 40  # not a multiple of BLOCK_N: the last program masks rows; k=96 with BLOCK_K=64 masks columns
    x = torch.randn(rows, k, device=DEVICE)
    w = torch.randn(2 * n if gated else n, k, device=DEVICE)
    b = torch.randn(w.shape[0], device=DEVICE)
    y = gemv_gpu.gemv_triton(x, w, b, gated=gated, config=(8, block_k, 4))
    assert y.shape == (rows, n)
    torch.testing.assert_close(y.double().cpu(), _reference(x, w, b, gated).cpu(), rtol=1e-5, atol=1e-4)


def test_fused_decoder_runs_converted_int4_models_like_the_model():
    model = ptq(tiny_model().float(), "int4-g32")
    tokens = torch.tensor([[3, 14, 15, 9, 26, 5]])
    want = model(tokens)
    assert can_fuse(model)
    decoder = FusedDecoder.from_model(model)
    att = model.layers["0"].attention
    qkv = decoder.blocks[0][1].qkv.packed
    assert att.wk.weight_int4.data_ptr() == qkv.weight_int4[att.wq.out_features:].data_ptr()
    torch.testing.assert_close(model(tokens), want, rtol=0, atol=0)  # the views hold the same numbers


def test_fused_int4_step_logits_equal_the_converted_model_forward():
    model = ptq(tiny_model().float(), "int4-g32-asym")  # torch's CPU int4 kernel takes float32, not float64
    fused_model = copy.deepcopy(model)
    plain, fused = _runner(model, False), _runner(fused_model, True)
    assert plain.fused is None and fused.fused is not None
    _steps_match(plain, fused, [[len(p) for p in PROMPTS[:3]], [1, 1, 1]], 1e-5)


@needs_kernels
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g32-asym"])
def test_int4_decode_with_norms_in_the_gemvs_equals_the_converted_model_forward(scheme, monkeypatch):
    """Decode steps of an int4 weight-only model run RMSNorm and residual adds inside the int4 GEMVs
    (FusedDecoder._int4_decode; on a GPU, or Triton interpreted on CPU); the logits equal the plain converted
    model's."""
    from fourfold.infer import fused_decoder
    from fourfold.quant.packing import Int4WeightLinear

    model = ptq(tiny_model().float(), scheme)
    fused_model = copy.deepcopy(model)
    plain, fused = _runner(model, False, DEVICE), _runner(fused_model, True, DEVICE)
    monkeypatch.setattr(Int4WeightLinear, "uses_gemv", lambda self, x: x.numel() // self.in_features <= 3)
    monkeypatch.setattr(fused_decoder, "INT4_FUSED_NORMS", True)   # the default; set in case an A/B run changed it
    calls = []
    original = fused_decoder.FusedDecoder._int4_decode
    monkeypatch.setattr(fused_decoder.FusedDecoder, "_int4_decode", lambda *a: calls.append(1) or original(*a))
    _steps_match(plain, fused, [[len(p) for p in PROMPTS[:3]], [1, 1, 1], [1, 1, 1]], 1e-4)
    assert len(calls) == 2   # the two decode steps, not the prefill
