"""Tensor and sequence parallelism applied to the Llama model with DTensor's `parallelize_module`.

    apply_tensor_parallel(model, mesh.get("tp"), sequence_parallel=True)   # before fully_shard
    with loss_context(True):                   # the loss's forward AND its backward inside
        loss = compute_loss(model(tokens), targets)   # logits: vocab-sharded DTensor, never gathered
        loss.backward()

What the plan (fourfold.parallel.tensor_plan) does, per block: q/k/v and w1/w3 are column-parallel
(each rank owns n_heads/tp query heads, n_kv_heads/tp kv heads and ffn_dim/tp MLP units; the model
infers its local heads from shapes), wo and w2 row-parallel. Forward communicates once after
attention and once after the MLP: an all-reduce, or with sequence parallel a reduce-scatter along the
sequence plus an all-gather before the next column-parallel linears (same bytes), so that the norms
and the residual stream hold seq/tp positions per rank. Backward does the dual collectives.

The token embedding is split by vocabulary rows, the output head by vocabulary columns; the loss is
computed by `loss_parallel()` from the vocab shards (three all-reduces of batch*seq numbers), so the
full logits never exist on one rank.

Contract for the trainer:
- every tp rank gets the same micro-batch (tokens replicated across the tp group);
- forward loss and backward run inside `loss_context(True)`; the loss is a replicated DTensor
  (`loss.full_tensor()` or `.to_local()` gives the plain value for logging, the same on every tp rank);
- after the last backward of a step and before clipping, `settle_partial_grads(model.parameters())`:
  under sequence parallel the norm weights' gradients come out of backward as pending sums over the tp
  ranks (DTensor `Partial`), and how the optimizer's ops treat those differs between torch releases
  (torch 2.11's AdamW stepped on each rank's unreduced share: the NCCL tp2 parity gap); settling them
  into the parameter's own placement once makes every release agree, with one small all-reduce per norm;
- parameters are DTensors on the tp mesh; without sequence parallel the norm weights stay plain
  tensors (every tp rank computes identical norm gradients), so code that mixes parameter kinds in one
  foreach kernel (torch's `clip_grad_norm_`, a single-group foreach AdamW) must group by mesh, as
  `fourfold.parallel.data_parallel.total_grad_norm` and the decay/no-decay optimizer groups do;
- FSDP goes on after this function (on the fsdp mesh of the same parent DeviceMesh): fully_shard then
  shards the DTensor weights along its own mesh dimension.

kv heads are split, never replicated: tp must divide n_kv_heads (ParallelMesh's layout check raises a
LayoutError before any group exists; `apply_tensor_parallel` checks again for direct callers). We
chose the error because replicated kv heads would need their gradients all-reduced over tp, and
Llama shapes (8 kv heads) cover tp <= 8, the size of an NVLink domain.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from fourfold.errors import LayoutError
from fourfold.layout import check_tensor_parallel
from fourfold.models.llama import Llama
from fourfold.ops.cross_entropy import IGNORE_INDEX
from fourfold.parallel.tensor_plan import block_plan, outer_plan


def _check_sequence_divides(tp: int):
    """A forward pre-hook: sequence parallel needs the token sequence to split evenly over tp ranks."""

    def hook(module, args, kwargs):
        """Raise LayoutError unless the tokens' sequence length is a multiple of tp."""
        tokens = args[0] if args else kwargs["tokens"]
        if tokens.shape[1] % tp:
            raise LayoutError(f"Sequence parallel splits each sequence over tp={tp} ranks, but this batch has "
                              f"{tokens.shape[1]} tokens per sequence; use a multiple of {tp} (train.seq_len) "
                              "or set --parallel.sequence_parallel false.")

    return hook


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> Llama:
    """Shard `model` (a Llama, or one pipeline chunk of it) over the 1-D tp mesh, in place; returns it.

    Call it before fully_shard (fourfold.parallel.apply says why the order is TP first). Tied
    embeddings stay tied: the head reuses the embedding's vocab-row shard, which is its column shard.
    """
    tp = tp_mesh.size()
    check_tensor_parallel(model.cfg, tp)
    has_embedding, has_head = model.tok_embeddings is not None, model.output is not None
    tied = has_embedding and has_head and model.output.weight is model.tok_embeddings.weight
    plan = outer_plan(sequence_parallel, has_embedding, has_head)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        # parallelize_module sharded the shared matrix twice (once per module); share one shard again
        # so the head's gradient and the embedding's accumulate into the same parameter.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        # Hidden states hold seq/tp positions per rank; the model needs this to size its rotary table.
        model.seq_shards = tp
        if has_embedding:
            model.register_forward_pre_hook(_check_sequence_divides(tp), with_kwargs=True)
    return model


def settle_partial_grads(params) -> None:
    """Give every DTensor gradient its parameter's placements, reducing pending sums (Partial) over their mesh.

    Call it after the step's last backward and before clipping and the optimizer; gradients already in
    their parameter's placements (every tp-sharded weight, all FSDP gradients) are left untouched.
    """
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
            p.grad = grad.redistribute(grad.device_mesh, p.placements)


def loss_context(tp_enabled: bool):
    """loss_parallel() when logits are vocab-sharded DTensors (tp > 1), else a context that does nothing.

    Both the loss's forward and its backward must run inside it: loss_parallel swaps the
    cross-entropy's forward and backward kernels for vocab-parallel ones.
    """
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


def compute_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of (batch, seq, vocab) logits against (batch, seq) targets, skipping IGNORE_INDEX targets:
    their mean, or with reduction="sum" their sum (what training divides by the global batch's token count).

    Plain logits give a plain tensor; vocab-sharded DTensor logits (inside `loss_context(True)`) give
    a replicated 0-d DTensor computed without gathering the vocabulary. Half-precision logits are
    widened to float32 first.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
