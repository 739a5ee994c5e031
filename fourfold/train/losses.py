"""The training loss for a layout: token-mean cross-entropy, vocab-parallel under tensor parallel.

    loss_fn, loss_context = build_loss(cfg, mesh)
    with loss_context():            # forward loss and backward both inside it
        loss = loss_fn(logits, targets)
"""

from __future__ import annotations

import contextlib
import functools

from fourfold.config import Config
from fourfold.mesh import ParallelMesh


def build_loss(cfg: Config, mesh: ParallelMesh):
    """(loss_fn(logits, targets) -> mean loss, loss_context() -> context manager) for this layout."""
    if mesh.size("tp") > 1:
        from fourfold.parallel.tensor import compute_loss, loss_context

        return compute_loss, functools.partial(loss_context, True)
    from fourfold.ops.cross_entropy import cross_entropy

    return functools.partial(cross_entropy, chunk=cfg.train.loss_chunk), contextlib.nullcontext
