"""The greedy-pick kernel (fourfold.infer.argmax_gpu) gives torch.argmax's index: ties, -inf rows, chunk edges.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) on CPU
tensors; on a GPU on CUDA tensors. CHUNK is made small so a row spans several chunks and ties cross them.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import DEVICE, require_triton_runtime

require_triton_runtime()
from fourfold.infer import argmax_gpu  # noqa: E402 - after the checks above
from fourfold.infer.sampler import greedy_argmax  # noqa: E402

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter mishandles bfloat16


def rows_with_ties(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 2).round().clamp(-6, 3)  # most rows hold their max many times
    x[0] = float("-inf")                                                 # all -inf: index 0
    x[1, :] = -1.0
    x[1, vocab - 1] = 7.0                                                # the max in the last, partial chunk
    x[2, :] = 0.0
    x[2, [70, 5, 200]] = 4.0                                             # one max value in two chunks
    return x


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("vocab", [300, 256, 5])
def test_first_maximum_like_torch_argmax(monkeypatch, dtype, vocab):
    monkeypatch.setattr(argmax_gpu, "CHUNK", 64)
    x = rows_with_ties(6, max(vocab, 201), seed=vocab)[:, :vocab].to(dtype).to(DEVICE)
    got = argmax_gpu.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got.cpu(), x.cpu().float().argmax(dim=-1))
    if vocab == 300:
        assert got[1].item() == 299 and got[2].item() == 5 and got[0].item() == 0


def test_one_chunk_and_a_strided_view():
    x = rows_with_ties(4, 1000, seed=1).to(DEVICE)
    wide = torch.zeros(4, 1200, device=DEVICE)
    wide[:, :1000] = x
    view = wide[:, :1000]                                                # row stride 1200
    assert torch.equal(argmax_gpu.argmax_rows(view).cpu(), x.cpu().argmax(dim=-1))
    assert argmax_gpu.argmax_rows(x[:0]).shape == (0,)


def test_the_sampler_takes_the_kernel_only_where_it_runs():
    x = rows_with_ties(3, 300, seed=2)
    assert not argmax_gpu.available(x) and not argmax_gpu.available(x.to(DEVICE).t())
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    if DEVICE == "cuda":
        assert argmax_gpu.available(x.cuda()) and torch.equal(greedy_argmax(x.cuda()).cpu(), x.argmax(dim=-1))
