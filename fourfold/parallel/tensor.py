"""Tensor and sequence parallelism applied to the Llama model with DTensor's `parallelize_module`.

    apply_tensor_parallel(model, mesh.get("tp"), sequence_parallel=True)
    with loss_context(True):                 # forward loss and backward inside
        loss = compute_loss(logits, targets)  # logits are vocab-sharded DTensors: never gathered

Every tp rank gets the same micro-batch (tokens replicated). Per block, forward does one all-reduce
after attention and one after the MLP (sequence parallel: an all-gather before each and a
reduce-scatter after, same bytes, and the norms and residuals hold 1/tp of the sequence); backward
does the duals. kv heads are split across ranks, so tp must divide n_kv_heads (fourfold.mesh checks
this and says so; we do not replicate kv heads).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from fourfold.parallel.tensor_plan import block_plan, outer_plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Shard `model` (a Llama or one pipeline chunk of it) over the 1-D tp mesh, in place."""
    plan = outer_plan(sequence_parallel, model.tok_embeddings is not None,
                      model.output is not None)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        # Hidden states hold seq/tp positions per rank; the model needs this to size its rotary table.
        model.seq_shards = tp_mesh.size()
    return model


def loss_context(tp_enabled: bool):
    """loss_parallel() when logits are vocab-sharded DTensors, else nothing."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


def compute_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy; vocab-parallel for DTensor logits (inside loss_context(True))."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
