"""Cross-entropy (token mean or sum) that never holds the full float32 logits at once.

`cross_entropy(logits, targets, chunk, reduction)`: with chunk = 0 it is `F.cross_entropy` on logits upcast
to at least float32. Targets equal to IGNORE_INDEX (-100, torch's default) add nothing and get no gradient;
the mean is over the other tokens. Training uses reduction="sum" and divides by the number of trained
tokens of the whole global batch itself (fourfold/train/runner/base.py). With chunk > 0 a custom autograd function walks the tokens `chunk` at a time: forward
computes each chunk's loss in float32 and, in the same pass, that chunk's gradient with respect to the
logits in the logits' own dtype; backward only scales the stored gradient. Peak extra memory is one
float32 chunk instead of a float32 copy of all logits (for the 1.1B shape at 4 x 2048 tokens: 1 GiB
avoided), and no second softmax pass is needed in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""A target that takes no loss: padding, and the prompt tokens of chat data."""

REDUCTIONS = ("mean", "sum")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, reduction: str):
        """Mean or sum cross-entropy over the tokens whose target is not IGNORE_INDEX; the logits' gradient is
        computed chunk by chunk and saved for backward."""
        flat = logits.reshape(-1, logits.shape[-1])
        tgt = targets.reshape(-1)
        keep = tgt != IGNORE_INDEX
        safe = torch.where(keep, tgt, 0)
        n = flat.shape[0]
        wide = _upcast(flat[:1]).dtype
        if reduction == "mean":
            divisor = keep.sum().clamp(min=1).to(wide)
        else:
            divisor = torch.ones((), dtype=wide, device=flat.device)
        grad = torch.empty_like(flat) if logits.requires_grad else None
        total = torch.zeros((), dtype=wide, device=flat.device)
        for start in range(0, n, chunk):
            part = _upcast(flat[start:start + chunk])
            t, k = safe[start:start + chunk], keep[start:start + chunk]
            lse = torch.logsumexp(part, dim=-1)
            total += torch.where(k, lse - part.gather(1, t[:, None]).squeeze(1), 0).sum()
            if grad is not None:
                g = torch.exp(part - lse[:, None])
                g[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                grad[start:start + chunk] = (g * (k[:, None].to(wide) / divisor)).to(flat.dtype)
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out):
        """The saved logits gradient scaled by `grad_out`; None for targets, chunk and reduction."""
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype)).view(ctx.shape), None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 0, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (..., vocab) against integer targets (...), skipping IGNORE_INDEX targets:
    their mean (reduction="mean") or their sum ("sum")."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk and chunk > 0:
        return _ChunkedCrossEntropy.apply(logits, targets, chunk, reduction)
    return F.cross_entropy(_upcast(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
