"""The training loss for a layout: cross-entropy summed over the trained tokens, vocab-parallel under tensor parallel.

Targets equal to IGNORE_INDEX (padding, chat prompts) take no loss. The step runner divides the sum by
its share of the global batch's trained tokens (fourfold/train/runner/base.py), so the step's loss is the
token mean over the whole global batch whatever the layout.

With compute.compile the plain cross-entropy is compiled too (whatever compute.compile_scope says), unless
compute.loss_chunk asks for the chunked one.

    loss_fn, loss_context = build_loss(cfg, mesh)
    with loss_context():            # forward loss and backward both inside it
        loss = loss_fn(logits, targets) / divisor
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fourfold.config import Config
from fourfold.mesh import ParallelMesh
from fourfold.ops.cross_entropy import cross_entropy
from fourfold.parallel.tensor import compute_loss, loss_context


def build_loss(cfg: Config, mesh: ParallelMesh):
    """(loss_fn(logits, targets) -> summed loss, loss_context() -> context manager) for this layout."""
    if mesh.size("tp") > 1:
        return functools.partial(compute_loss, reduction="sum"), functools.partial(loss_context, True)

    if cfg.compute.compile and cfg.compute.loss_chunk == 0:
        # Compiled, the upcast, log-softmax and their backward fuse into one pass each way over the
        # low-precision logits: no float32 copy of the logits is made or kept for backward.
        return torch.compile(functools.partial(cross_entropy, reduction="sum"), fullgraph=True), contextlib.nullcontext
    return functools.partial(cross_entropy, chunk=cfg.compute.loss_chunk, reduction="sum"), contextlib.nullcontext
