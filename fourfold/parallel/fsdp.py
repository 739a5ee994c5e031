"""Fully sharded data parallel (ZeRO-3, and ZeRO-2 by keeping parameters gathered) with FSDP2's fully_shard.

Each transformer block is one FSDP unit (its parameters all-gathered together before its forward and
backward, its gradients reduce-scattered after its backward), the root holds the embedding, final norm
and head. On a 2-D (dp, shard) mesh FSDP2 shards inside a group and replicates across groups: HSDP.
Prefetch: each block asks FSDP to all-gather the next `prefetch` blocks when it starts (forward) and the
previous ones in backward; FSDP2 bounds the all-gathers in flight itself, and `max_inflight_allgathers`
caps our explicit prefetch list at that many blocks ahead.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from fourfold.config import ParallelConfig
from fourfold.precision import DTYPES


def mixed_precision(p: ParallelConfig) -> MixedPrecisionPolicy:
    """param_dtype fp32 means 'leave parameters in their own dtype' (float64 runs stay float64)."""
    param = None if p.param_dtype == "fp32" else DTYPES[p.param_dtype]
    reduce = None if p.reduce_dtype == "fp32" else DTYPES[p.reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, p: ParallelConfig, reshard_after_forward: bool) -> nn.Module:
    """Shard `model` (a Llama or a pipeline chunk of one) over `mesh` block by block, then the root."""
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision(p))
    if p.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    depth = max(0, min(p.prefetch, p.max_inflight_allgathers))
    if depth > 0 and len(blocks) > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
            block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - depth):i])))
    return model
