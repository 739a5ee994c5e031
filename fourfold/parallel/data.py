"""Data parallelism: how gradients are synchronised and where parameters and optimizer state live.

The trainer talks to one `DataParallel` object and never to DDP/FSDP directly:

    dp = build_data_parallel(mesh, cfg, device)
    model = dp.wrap(model)                    # last step of fourfold.parallel.apply.parallelize
    optimizer = dp.build_optimizer(model)
    with dp.grad_sync(model, enabled=is_last_micro_step): loss.backward()
    norm = dp.clip_grad_norm(model, max_norm)
    dp.memory_report(model, optimizer)        # bytes this rank holds

This first version is the single-process strategy; the data-parallel strategies extend it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fourfold.config import Config
from fourfold.mesh import ParallelMesh
from fourfold.train.optim import build_adamw


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
    """Single-process strategy: no communication."""

    name = "none"

    def __init__(self, mesh: ParallelMesh, cfg: Config, device: torch.device):
        self.mesh, self.cfg, self.device = mesh, cfg, device

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_adamw(model, self.cfg.train, self.device)

    def grad_sync(self, model: nn.Module, enabled: bool):
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm <= 0:
            return torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def memory_report(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {
            "param_bytes": tensor_bytes(model.parameters()),
            # Gradients are freed between steps; count what they occupy during backward (one per parameter).
            "grad_bytes": tensor_bytes(p for p in model.parameters() if p.requires_grad),
            "optim_bytes": tensor_bytes(states),
        }


def build_data_parallel(mesh: ParallelMesh, cfg: Config, device: torch.device) -> DataParallel:
    """The strategy the layout asks for."""
    return DataParallel(mesh, cfg, device)
