"""Data parallelism: how gradients are synchronised and where parameters and optimizer state live.

The trainer talks to one `DataParallel` object and never to DDP/FSDP directly:
    dp = build_data_parallel(mesh, cfg.parallel, cfg.optim, device)
    model = dp.wrap(model)                    # step 6 of fourfold.parallel.apply (after its transforms)
    optimizer = dp.build_optimizer(model)
    with dp.grad_sync(model, enabled=is_last_micro_step): loss.backward()
    norm = dp.clip_grad_norm(model, max_norm, optimizer)   # fused AdamW: the clip rides on its kernel
    dp.memory_report(model, optimizer)        # bytes this rank holds

Strategies: four classes, chosen from the layout by `fourfold.layout.data_parallel_strategy`:
| strategy | layouts | communicates | each rank holds |
|---|---|---|---|
| `none`: `DataParallel` | dp = fsdp = cp = 1 (one process; tp or pp alone) | nothing (tp and pp communicate themselves) | everything of its tp/pp part |
| `ddp`: `DDP`, DistributedDataParallel | dp=N (no tp, cp, fsdp) | all-reduce of gradients in `bucket_mb` buckets during backward (in `reduce_dtype`: bf16 halves the bytes) | everything |
| `zero1`: `Zero1`, DDP + ZeroRedundancyOptimizer | fsdp=N, zero=1 (no dp, tp, cp) | gradient all-reduce, parameter broadcast after the step | full params and grads, 1/N optimizer state |
| `fsdp`: `FSDP`, FSDP2's fully_shard | fsdp=N with zero 2 or 3; every other layout with dp, fsdp or cp > 1 (tp or cp > 1, or zero=1 with dp > 1) | all-gathers of parameters, gradient reduce-scatter | 1/N of params, grads and optimizer state |

Settings, not strategies:
- `ddp` with `parallel.hierarchical_allreduce`: a comm hook that reduce-scatters in the node, all-reduces
  across nodes and all-gathers in the node (the same sum, 1/G of the bytes across nodes).
- `fsdp` with zero=2 keeps parameters gathered from forward to backward (one all-gather per step; full
  parameters during the step); zero=3 (default) reshards them after each block's forward.
- `fsdp` with dp=R and fsdp (or cp) = S runs on the 2-D (dp, shard) mesh: HSDP, all-gathers inside a shard
  group and gradients all-reduced across groups; each rank holds 1/S.

Context-parallel ranks (cp > 1) reduce gradients like data ranks: fsdp and cp form one shard dimension.
With tensor parallel (DTensor parameters, which DDP cannot hold) or context parallel, every data
layout runs on FSDP2 (dp alone then shards over dp; the gradients are identical to DDP's).

Built on the meta device (`fourfold.parallel.build`): `wraps_meta_models` says whether `wrap` takes a
model without storage (FSDP2 shards shapes, and each rank materialises only its shards afterwards) or
needs it materialised first (DDP and ZeRO-1 hold whole parameters anyway); `parameter_device` is where
the parameters live (the CPU under FSDP's cpu_offload).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from fourfold.config import OptimConfig, ParallelConfig
from fourfold.layout import data_parallel_strategy
from fourfold.mesh import ParallelMesh
from fourfold.optim import adamw_kwargs, build_adamw, decay_groups, fold_clip, folds_clipping
from fourfold.parallel.ddp_hierarchical import HierarchicalState, hierarchical_allreduce_hook
from fourfold.parallel.fsdp import apply_fsdp
from fourfold.parallel.grad_norm import clip_with_norm, total_grad_norm
from fourfold.precision import DTYPES


def tensor_bytes(tensors) -> int:
    """Bytes held locally by an iterable of tensors (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


class DataParallel:
    """Single-process strategy (also the base of the others): no communication."""

    name = "none"
    wraps_meta_models = False

    def __init__(self, mesh: ParallelMesh, parallel: ParallelConfig, optim: OptimConfig, device: torch.device):
        self.mesh, self.parallel, self.optim, self.device = mesh, parallel, optim, device

    @property
    def parameter_device(self) -> torch.device:
        """Where this strategy keeps the parameters: the training device."""
        return self.device

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model prepared for this strategy (here unchanged)."""
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW over the model's parameters, norms without weight decay."""
        return build_adamw(model, self.optim, self.device)

    def grad_sync(self, model: nn.Module, enabled: bool):
        """Context for one backward; `enabled=False` defers gradient synchronisation (here there is none)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip gradients to `max_norm` (0: no clipping); return the total gradient norm before clipping.

        Given the `optimizer` about to step and it is torch's fused AdamW over plain tensors, the scaling
        is left to its kernel (`fourfold.optim.fold_clip`); the gradients are then scaled during
        `optimizer.step()` instead of here.
        """
        params = [p for p in model.parameters() if p.grad is not None]
        norm = total_grad_norm(params)
        if optimizer is not None and folds_clipping(optimizer):
            fold_clip(optimizer, norm, max_norm if params else 0.0)
        elif max_norm > 0 and params:
            clip_with_norm(params, max_norm, norm)
        return norm

    def memory_report(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds: param_bytes, grad_bytes (one gradient per trainable parameter), optim_bytes."""
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return {
            "param_bytes": tensor_bytes(model.parameters()),
            # Gradients are freed between steps; count what they occupy during backward (one per parameter shard).
            "grad_bytes": tensor_bytes(p for p in model.parameters() if p.requires_grad),
            "optim_bytes": tensor_bytes(states),
        }


def low_precision_allreduce_hook(dtype: torch.dtype):
    """A DDP comm hook that all-reduces each gradient bucket in `dtype` (bf16/fp16): half the bytes of fp32.

    The bucket is cast, divided by the group size, averaged across the group and copied back into the fp32
    bucket. torch's own bf16 compression hook refuses to run off CUDA/NCCL, so this one is ours (a few
    lines, testable on gloo, which reduces bf16). validate_layout keeps it off the hierarchical all-reduce.
    """

    def hook(group, bucket):  # no return annotation: DDP checks it against the real type, not a string
        """Start the bucket's low-precision all-reduce; the future yields the averaged fp32 bucket."""
        full = bucket.buffer()
        low = full.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(low, group=group, async_op=True).get_future()

        def widen(done) -> torch.Tensor:
            """Copy the averaged low-precision bucket back into DDP's fp32 bucket."""
            full.copy_(done.value()[0])
            return full

        return future.then(widen)

    return hook


class DDP(DataParallel):
    """DistributedDataParallel over the dp group: bucketed gradient all-reduce overlapped with backward."""

    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model in DistributedDataParallel over the dp group, with the hierarchical all-reduce hook if asked."""
        p = self.parallel
        ids = [self.device.index] if self.device.type == "cuda" else None
        # broadcast_buffers off: the model's only buffers are the rotary tables, computed identically on every
        # rank, so broadcasting them before each forward would be a wasted collective and a sync point.
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=self.mesh.group("dp"),
                                                  bucket_cap_mb=p.bucket_mb, gradient_as_bucket_view=True,
                                                  broadcast_buffers=False)
        if p.hierarchical_allreduce:
            per_node = p.gpus_per_node or _local_world_size()
            ddp.register_comm_hook(HierarchicalState(self.mesh.node_mesh(per_node)), hierarchical_allreduce_hook)
        elif p.reduce_dtype != "fp32":
            ddp.register_comm_hook(self.mesh.group("dp"), low_precision_allreduce_hook(DTYPES[p.reduce_dtype]))
        return ddp

    def grad_sync(self, model: nn.Module, enabled: bool):
        """A no-op context when `enabled`, else DDP's `no_sync()` (gradients accumulate without all-reduce)."""
        return contextlib.nullcontext() if enabled else model.no_sync()


class Zero1(DDP):
    """DDP gradients, optimizer state sharded with torch's ZeroRedundancyOptimizer over the fsdp group."""

    name = "zero1"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model in DistributedDataParallel over the fsdp group."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        # Gradients as views into DDP's buckets: no second copy of the gradients.
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=self.mesh.group("fsdp"),
                                                   bucket_cap_mb=self.parallel.bucket_mb,
                                                   gradient_as_bucket_view=True, broadcast_buffers=False)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A ZeroRedundancyOptimizer (AdamW, norms without weight decay) sharding its state over the fsdp group."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = decay_groups(model, self.optim.weight_decay)
        kwargs = adamw_kwargs(self.optim, self.device)
        kwargs.pop("foreach", None)
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      process_group=self.mesh.group("fsdp"), parameters_as_bucket_view=False,
                                      weight_decay=groups[0]["weight_decay"], **kwargs)
        opt.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
        return opt

    def memory_report(self, model, optimizer) -> dict[str, int]:
        """The base report, with only this rank's shard of the optimizer state."""
        report = super().memory_report(model, optimizer.optim)
        return report


class FSDP(DataParallel):
    """FSDP2 over the data mesh: zero=3 reshards parameters after forward, zero=2 keeps them gathered."""

    name = "fsdp"
    wraps_meta_models = True

    @property
    def parameter_device(self) -> torch.device:
        """The CPU under parallel.cpu_offload (FSDP2 keeps the sharded parameters there), else the device."""
        return torch.device("cpu") if self.parallel.cpu_offload else self.device

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model sharded with FSDP2 over the data mesh (a 2-D HSDP mesh when dp > 1 and fsdp or cp > 1)."""
        return apply_fsdp(model, self.mesh.hsdp_mesh(), self.parallel)

    def grad_sync(self, model: nn.Module, enabled: bool):
        """Switch FSDP's gradient reduction on or off for the coming backward; returns a no-op context."""
        for m in model.modules() if isinstance(model, nn.ModuleList) else [model]:
            if hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()


def _local_world_size() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def build_data_parallel(mesh: ParallelMesh, parallel: ParallelConfig, optim: OptimConfig,
                        device: torch.device) -> DataParallel:
    """The strategy the layout asks for (`fourfold.mesh.data_parallel_strategy`; table in the module docstring)."""
    classes = {"none": DataParallel, "ddp": DDP, "zero1": Zero1, "fsdp": FSDP}
    return classes[data_parallel_strategy(parallel)](mesh, parallel, optim, device)
