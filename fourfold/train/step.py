"""One optimizer step's forward and backward over its micro-batches, and the validation pass.

Every micro-batch's loss is a mean over its tokens and is divided by the number of micro-batches, so
the accumulated gradient is the gradient of the mean loss over the global batch — the same on every
layout, which is what the parity tests check.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class StepContext:
    """What a forward/backward needs besides the model and data."""

    device: torch.device
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_context: Callable[[], contextlib.AbstractContextManager]
    autocast: Callable[[], contextlib.AbstractContextManager]
    shard_batch: Callable | None = None
    """Context parallel: (inputs, targets) -> (inputs, targets, positions) for this rank's chunk."""
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
    """fp16: multiply the loss by the loss scale before backward."""


def as_plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the vocab-parallel loss) as an ordinary tensor, for accumulation."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _prepare(inputs: torch.Tensor, targets: torch.Tensor, ctx: StepContext):
    inputs = inputs.to(ctx.device, non_blocking=True)
    targets = targets.to(ctx.device, non_blocking=True)
    if ctx.shard_batch is not None:
        return ctx.shard_batch(inputs, targets)
    return inputs, targets, None


def forward_backward(model: nn.Module, micro_batches: list, ctx: StepContext, grad_sync) -> torch.Tensor:
    """Accumulate gradients over `micro_batches`; return this rank's mean loss (a detached tensor).

    `grad_sync(enabled)` returns the data-parallel context that skips gradient communication on all
    but the last micro-batch.
    """
    n = len(micro_batches)
    total = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for i, (inputs, targets) in enumerate(micro_batches):
        inputs, targets, positions = _prepare(inputs, targets, ctx)
        with grad_sync(i == n - 1), ctx.loss_context():
            with ctx.autocast():
                logits = model(inputs, positions)
            loss = ctx.loss_fn(logits, targets)
            scaled = loss / n
            if ctx.scale_loss is not None:
                scaled = ctx.scale_loss(scaled)
            scaled.backward()
        total += as_plain_tensor(loss.detach())
    return total / n


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, ctx: StepContext) -> torch.Tensor:
    """Mean loss over validation `batches` on this rank (a tensor; the caller averages across ranks)."""
    total = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for inputs, targets in batches:
        inputs, targets, positions = _prepare(inputs, targets, ctx)
        with ctx.loss_context(), ctx.autocast():
            total += as_plain_tensor(ctx.loss_fn(model(inputs, positions), targets)).double()
    return total / max(1, len(batches))
