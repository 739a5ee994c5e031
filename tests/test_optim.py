"""Clipping folded into torch's fused AdamW equals explicit clipping followed by the step."""

from __future__ import annotations

import pytest
import torch

from fourfold.config import ModelConfig
from fourfold.models.llama import Llama
from fourfold.parallel.data_parallel import DataParallel
from fourfold.optim import folds_clipping


def _model_with_grads(seed: int = 0) -> Llama:
    """A tiny float32 Llama after one backward on fixed random tokens."""
    torch.manual_seed(seed)
    model = Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return model


@pytest.mark.parametrize("max_norm", [0.05, 1e6, 0.0])  # clipping active, inactive, switched off
def test_folded_clip_matches_explicit_clip(max_norm):
    folded = _model_with_grads()
    explicit = _model_with_grads()  # the same model and gradients (deepcopy drops .grad)
    dp = DataParallel(mesh=None, parallel=None, optim=None, device=torch.device("cpu"))  # clipping uses neither
    opt_folded = torch.optim.AdamW(folded.parameters(), lr=1e-2, eps=0.1, fused=True)  # a large eps: the step depends on the gradient scale
    opt_explicit = torch.optim.AdamW(explicit.parameters(), lr=1e-2, eps=0.1, foreach=True)
    assert folds_clipping(opt_folded) and not folds_clipping(opt_explicit)

    norm_folded = dp.clip_grad_norm(folded, max_norm, opt_folded)
    norm_explicit = dp.clip_grad_norm(explicit, max_norm, opt_explicit)
    assert float(norm_folded) == pytest.approx(float(norm_explicit), rel=1e-12)
    if 0 < max_norm < float(norm_folded):
        # Folded: the gradients are untouched until the step; explicit: already scaled.
        g_f, g_e = folded.output.weight.grad, explicit.output.weight.grad
        torch.testing.assert_close(g_f * (max_norm / (float(norm_folded) + 1e-6)), g_e)
    opt_folded.step()
    opt_explicit.step()
    for (name, a), b in zip(folded.named_parameters(), explicit.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
