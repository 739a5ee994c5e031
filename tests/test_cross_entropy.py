"""The chunked cross-entropy equals F.cross_entropy in value and gradient, whatever the chunk size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fourfold.ops.cross_entropy import IGNORE_INDEX, cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_torch_cross_entropy(chunk, dtype):
    gen = torch.Generator().manual_seed(chunk)
    logits = (3 * torch.randn(2, 32, 50, generator=gen, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, 50, (2, 32), generator=gen)
    upstream = torch.tensor(1.7, dtype=dtype)

    ours = cross_entropy(logits, targets, chunk)
    (grad,) = torch.autograd.grad(ours * upstream, logits)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    (ref_grad,) = torch.autograd.grad(ref * upstream, logits)

    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(grad, ref_grad, **tol)


def test_bfloat16_logits_are_reduced_in_float32():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, 40, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 40, (4, 16), generator=gen)
    ours = cross_entropy(logits, targets, chunk=8)
    assert ours.dtype == torch.float32
    ours.backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.detach().float().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(ours.detach(), ref, rtol=1e-6, atol=1e-6)


def test_compiled_training_loss_matches_the_eager_one(tmp_path):
    """compute.compile compiles the plain cross-entropy (inductor on CPU): same value and gradient, logits' dtype kept."""
    from fourfold.config import build_config
    from fourfold.mesh import ParallelMesh
    from fourfold.train.losses import build_loss

    cfg = build_config({}, {"compute.compile": "true", "compute.device": "cpu"})
    loss_fn, _ = build_loss(cfg, ParallelMesh.build(cfg))
    assert loss_fn is not cross_entropy and hasattr(loss_fn, "_torchdynamo_orig_callable")  # really compiled
    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = (3 * torch.randn(2, 24, 70, generator=gen)).to(dtype).requires_grad_()
        targets = torch.randint(0, 70, (2, 24), generator=gen)
        ours = loss_fn(logits, targets)
        (grad,) = torch.autograd.grad(ours * 1.7, logits)
        # the training loss is the sum over tokens; the runner divides it by the global batch's token count
        ref = F.cross_entropy(logits.detach().float().flatten(0, 1), targets.flatten(), reduction="sum")
        ref_logits = logits.detach().float().requires_grad_()
        (ref_grad,) = torch.autograd.grad(1.7 * F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(),
                                                                reduction="sum"), ref_logits)
        assert ours.dtype == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(ours.detach(), ref, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad.float(), ref_grad, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignored_targets_take_no_loss_and_no_gradient(chunk, reduction):
    """IGNORE_INDEX targets (padding, chat prompts) are left out of the value, the mean's count and the gradient."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 10, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (3, 10), generator=gen)
    ignored = torch.rand(3, 10, generator=gen) < 0.4
    targets[ignored] = IGNORE_INDEX
    ours = cross_entropy(logits, targets, chunk, reduction)
    (grad,) = torch.autograd.grad(ours, logits)
    kept = logits.detach()[~ignored].requires_grad_()
    ref = F.cross_entropy(kept, targets[~ignored], reduction=reduction)  # only the trained rows exist here
    (ref_grad,) = torch.autograd.grad(ref, kept)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad[~ignored], ref_grad, rtol=1e-12, atol=1e-15)
    assert grad[ignored].abs().max() == 0
