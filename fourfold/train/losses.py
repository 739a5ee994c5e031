"""The training loss for a layout: token-mean cross-entropy, vocab-parallel under tensor parallel.

With compute.compile the plain cross-entropy is compiled too (whatever compute.compile_scope says), unless
compute.loss_chunk asks for the chunked one.

    loss_fn, loss_context = build_loss(cfg, mesh)
    with loss_context():            # forward loss and backward both inside it
        loss = loss_fn(logits, targets)
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
    """(loss_fn(logits, targets) -> mean loss, loss_context() -> context manager) for this layout."""
    if mesh.size("tp") > 1:
        return compute_loss, functools.partial(loss_context, True)

    if cfg.compute.compile and cfg.compute.loss_chunk == 0:
        # Compiled, the upcast, log-softmax and their backward fuse into one pass each way over the
        # low-precision logits: no float32 copy of the logits is made or kept for backward.
        return torch.compile(cross_entropy, fullgraph=True), contextlib.nullcontext
    return functools.partial(cross_entropy, chunk=cfg.compute.loss_chunk), contextlib.nullcontext
