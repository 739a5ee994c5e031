"""The few collectives fourfold writes itself, as autograd functions whose backward is the dual collective.

    all_gather_along(x, dim, group)      forward all-gather along dim, backward reduce-scatter
    reduce_scatter_along(x, dim, group)  forward reduce-scatter along dim, backward all-gather
    ring_shift(tensors, group)           forward: send to rank+1, receive from rank-1; backward: the reverse

Everything else uses PyTorch's own distributed pieces (DDP, FSDP2, DTensor). The transport is always
torch.distributed (NCCL or gloo); these only arrange its calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = [p.contiguous() for p in x.chunk(world, dim=dim)]
    out = torch.empty_like(parts[rank])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (backward: each rank gets the sum of its slice's grads)."""
    return _AllGather.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over ranks and keep this rank's slice along `dim` (backward: all-gather)."""
    return _ReduceScatter.apply(x, dim, group)


def _shift(tensors: list[torch.Tensor], group, step: int) -> list[torch.Tensor]:
    """Send each tensor to group rank (r + step) and receive from (r - step), batched."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, (rank + step) % world)
    src = dist.get_global_rank(group, (rank - step) % world)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, src, group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(_shift(list(tensors), group, 1))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_shift([g.contiguous() for g in grads], ctx.group, -1))


def ring_shift(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Pass tensors one step around the ring of `group` (differentiable: gradients travel back)."""
    return list(_RingShift.apply(group, *tensors))
