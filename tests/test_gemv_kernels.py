"""The decode GEMV kernels (fourfold.infer.gemv_gpu, fourfold.quant.int4_gemv) against a float64 reference, and the
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
from fourfold.quant import int4_gemv
from fourfold.quant.packing import pack_int4
from fourfold.quant.qat import ptq
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.sequence import Sequence
from tests.engine_helpers import GREEDY, tiny_model
from tests.test_engine_fused import PROMPTS, _step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    gemv_gpu.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported)")


def _runner(model, fuse: bool) -> ModelRunner:
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, 32, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    return ModelRunner(model, pool, torch.device("cpu"), fuse=fuse)


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


@needs_kernels
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,group,gpi,symmetric", [(1, 32, 2, True), (2, 32, 4, False), (3, 64, 1, False)])
def test_int4_gemv_matches_dequantized_float64(gated, rows, group, gpi, symmetric):
    torch.manual_seed(rows + group)
    n, k = 24, 192  # 6 or 3 groups per row: with gpi 4 the last iteration masks groups
    x = torch.randn(rows, k, device=DEVICE)
    q = torch.randint(-8, 8, (2 * n if gated else n, k))
    scales = torch.rand(q.shape[0], k // group) + 0.1
    zeros = (torch.zeros if symmetric else torch.randint)(*(() if symmetric else (-8, 8)), (q.shape[0], k // group),
                                                          dtype=torch.int8)
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    b = torch.randn(q.shape[0])
    dev = [t.to(DEVICE) for t in (pack_int4(q + 8), scales, zeros, b)]
    y = int4_gemv.int4_gemv(x, *dev[:3], group, dev[3], gated=gated, config=(8, gpi, 4), asym=not symmetric)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y.double().cpu(), _reference(x.cpu(), w, b, gated), rtol=1e-5, atol=1e-3)


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
    seqs = {r: [Sequence(str(i), p, GREEDY, i) for i, p in enumerate(PROMPTS[:3])] for r in ("plain", "fused")}
    for sizes in ([len(p) for p in PROMPTS[:3]], [1, 1, 1]):
        want = _step(plain, seqs["plain"], sizes)
        got = _step(fused, seqs["fused"], sizes)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for r in seqs.values():
            for s in r:
                s.output_ids.append(5)
