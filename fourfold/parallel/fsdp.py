"""Fully sharded data parallel (ZeRO-3, and ZeRO-2 by keeping parameters gathered) with FSDP2's fully_shard.

Each transformer block is one FSDP unit (its parameters all-gathered together before its forward and
backward, its gradients reduce-scattered after its backward), the root holds the embedding, final norm
and head. On a 2-D (dp, shard) mesh FSDP2 shards inside a group and replicates across groups: HSDP.
Prefetch: each block asks FSDP to all-gather the next `prefetch` blocks when it starts (forward) and the
previous ones in backward; FSDP2 bounds the all-gathers in flight itself, and `max_inflight_allgathers`
caps our explicit prefetch list at that many blocks ahead.

The policies are pure functions of the ParallelConfig, so that `apply_fsdp` and the memory model
(`fourfold.plan.memory`) read the same rule: `reshards_after_forward`, `block_reshards_after_forward`,
`prefetch_depth` and `fsdp_dtypes`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from fourfold.config import ParallelConfig
from fourfold.precision import DTYPES


def reshards_after_forward(p: ParallelConfig) -> bool:
    """Whether FSDP frees gathered parameters after forward: parallel.reshard_after_forward, except under
    ZeRO-2 (fsdp > 1 with zero 2), which keeps them gathered from forward to backward."""
    return p.reshard_after_forward and not (p.fsdp > 1 and p.zero == 2)


def block_reshards_after_forward(p: ParallelConfig, index: int, count: int) -> bool:
    """Whether block `index` of a model chunk's `count` blocks reshards after forward.

    The last block's parameters are needed again at once by backward, so it stays gathered.
    """
    return reshards_after_forward(p) and index < count - 1


def prefetch_depth(p: ParallelConfig) -> int:
    """Blocks whose all-gather each block starts ahead of use: parallel.prefetch, capped by max_inflight_allgathers."""
    return max(0, min(p.prefetch, p.max_inflight_allgathers))


def fsdp_dtypes(p: ParallelConfig, master: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(dtype forward and backward see parameters in, dtype gradients are reduce-scattered in) under FSDP.

    "fp32" means full precision, i.e. the master dtype (`fourfold.precision.master_dtype`): a float64 run
    stays float64 unless a lower dtype is asked for.
    """
    param = master if p.param_dtype == "fp32" else DTYPES[p.param_dtype]
    reduce = master if p.reduce_dtype == "fp32" else DTYPES[p.reduce_dtype]
    return param, reduce


def mixed_precision(p: ParallelConfig, master: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2's policy for `fsdp_dtypes`; a dtype equal to what FSDP2 would use anyway is left unset (None)."""
    param, reduce = fsdp_dtypes(p, master)
    # FSDP2 reduces in the parameter dtype when reduce_dtype is None, so it is set whenever they differ.
    return MixedPrecisionPolicy(param_dtype=None if param == master else param,
                                reduce_dtype=None if reduce == param else reduce)


def _master_dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (the master dtype it was built in)."""
    dtypes = {prm.dtype for prm in model.parameters() if prm.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"apply_fsdp expects parameters of one floating-point dtype, found {sorted(map(str, dtypes))}.")
    return dtypes.pop()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, p: ParallelConfig) -> nn.Module:
    """Shard `model` (a Llama or a pipeline chunk of one) over `mesh` block by block, then the root.

    Whether parameters reshard after forward is `block_reshards_after_forward`'s decision (ZeRO-2 and
    the last block keep theirs gathered); the same policy functions feed the memory model.
    """
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision(p, _master_dtype_of(model)))
    if p.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=block_reshards_after_forward(p, i, len(blocks)), **kwargs)
    fully_shard(model, reshard_after_forward=reshards_after_forward(p), **kwargs)
    depth = prefetch_depth(p)
    if depth > 0 and len(blocks) > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
            block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - depth):i])))
    return model
