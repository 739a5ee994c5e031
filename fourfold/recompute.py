"""Activation recomputation (checkpointing) of transformer blocks: none, full, every-N and selective.

    apply_recompute(model, "selective")     # in place; parameter names are unchanged

- `full`: each block keeps only its input; its whole forward runs again during backward.
- `every-N`: blocks 0, N, 2N, ... are recomputed in full, the others keep everything (a dial between
  none and full).
- `selective`: every block keeps the outputs of its matmuls and of the attention kernel, and recomputes
  the cheap element-wise work around them (RMSNorm, rotary embedding, SiLU and the gate product, dtype
  casts). That is the Korthikanti et al. idea of recomputing what is cheap to redo per byte saved; with
  flash attention the score matrix is never stored, so what is left to drop is the element-wise work.

Blocks are checkpointed by replacing the block's `forward` on the instance (not by wrapping the module),
so state-dict keys, FSDP's per-block hooks and per-block `torch.compile` see the same module tree as
without recomputation. Checkpointing is torch.utils.checkpoint, non-reentrant; selective uses its
selective-checkpoint policy.

`saved_activation_bytes(fn)` measures what a forward leaves alive for backward, for tests and the
memory report.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten

# Ops whose outputs selective recomputation keeps: the matmuls (float8 ones too) and the fused attention kernels.
_SAVED_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and attention outputs; recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_forward(block: nn.Module, selective: bool, *args, **kwargs):
    """The block's own forward under torch.utils.checkpoint (non-reentrant)."""
    extra = {"context_fn": _selective_contexts} if selective else {}
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **extra, **kwargs)


def recomputed_blocks(mode: str, n_blocks: int) -> list[int]:
    """Indices (among this model's blocks, in order) that `mode` recomputes."""
    if mode == "none":
        return []
    if mode in ("full", "selective"):
        return list(range(n_blocks))
    if mode.startswith("every-"):
        every = int(mode.split("-", 1)[1])
        return [i for i in range(n_blocks) if i % every == 0]
    raise ValueError(f"unknown recompute mode '{mode}' (none, full, selective, every-N)")


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint the blocks of `model` (a Llama or a pipeline chunk; blocks in `model.layers`) in place."""
    blocks = list(model.layers.values())
    for i in recomputed_blocks(mode, len(blocks)):
        block = blocks[i]
        block.forward = functools.partial(_checkpointed_forward, block, mode == "selective")
    return model


class _LiveOutputs(TorchDispatchMode):
    """Remembers (weakly) every tensor an op produces while active."""

    def __init__(self):
        super().__init__()
        self.outputs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.outputs.append(weakref.ref(t))
        return out


def saved_activation_bytes(fn, exclude: tuple[torch.Tensor, ...] = ()) -> tuple[object, int]:
    """(fn(), bytes of the tensors fn created that are still alive when it returns).

    Called on a forward that returns its loss, the live tensors are what autograd keeps for backward
    (plus the returned value itself, and anything in `exclude`, which is not counted). Storages shared by
    views are counted once.
    """
    mode = _LiveOutputs()
    with mode:
        result = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    for ref in mode.outputs:
        t = ref()
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
    return result, sum(storages.values())
