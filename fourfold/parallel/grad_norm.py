"""Gradient norms and clipping over sharded gradients: DTensor shards (FSDP, TP) and pipeline stages.

The norm is always the global one, the norm of the gradient of the whole model over all ranks, so every
layout clips exactly as one process would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _by_mesh(params) -> list[list[torch.Tensor]]:
    """Parameters with gradients, grouped so foreach kernels never mix plain tensors and DTensors of
    different meshes (tensor parallel leaves norms plain and shards linears)."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    return list(groups.values())


def clip_with_norm(params, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm), group by group."""
    for group in _by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm.to(group[0].grad.dtype), foreach=True)


def total_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """2-norm over all gradients; DTensor gradients (FSDP/TP shards) are reduced over their meshes."""
    groups = _by_mesh(params)
    if not groups:
        return torch.zeros((), dtype=torch.float64)
    squares = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.double() ** 2)
    return torch.stack(squares).sum().sqrt()


def clip_across_stages(params, max_norm: float, pp_group) -> torch.Tensor:
    """Clip by the global gradient norm over all pipeline stages (each stage holds some parameters)."""
    with_grad = [p for p in params if p.grad is not None]
    squared = (total_grad_norm(with_grad).double() ** 2).reshape(1).to(with_grad[0].device if with_grad else "cpu")
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()[0]
    if max_norm > 0 and with_grad:
        clip_with_norm(with_grad, max_norm, total)
    return total
