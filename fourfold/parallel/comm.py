"""The few collectives fourfold writes itself (context parallelism's), the differentiable one as an autograd
function whose backward is the dual collective.

    all_gather_along(x, dim, group)      forward all-gather along dim     backward reduce-scatter along dim
    send_recv_next(tensors, group)       send to group rank r+1, receive from r-1 (not differentiable)

`all_gather_along` treats each rank's loss as one term of a sum over ranks: the gradient of a gathered
tensor is summed over ranks and each rank keeps its own slice. Tensor parallelism needs no collectives
of ours: DTensor's `parallelize_module` brings its own.

Every function takes its process group explicitly. The transport is always torch.distributed (NCCL on
GPUs, gloo on CPUs); these only arrange its calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the single-tensor collectives; 2.11 (the GPU machines) only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in group-rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum of every rank's `x`, cut into world equal slices along `dim`; this rank's slice.

    Only the backward of `_gather` calls it, with a gradient of world times the gathered size along `dim`.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


class _AllGatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        """Every rank's `x` concatenated along `dim`."""
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        """The gradient reduce-scattered along `dim`."""
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in group-rank order (backward: reduce-scatter the grad)."""
    return _AllGatherAlong.apply(x, dim, group)


class PendingExchange:
    """Receives in flight from `send_recv_next(..., async_op=True)`; `wait()` returns the received tensors."""

    def __init__(self, works: list, received: list[torch.Tensor]):
        self._works, self._received = works, received

    def wait(self) -> list[torch.Tensor]:
        """Wait until the exchange's sends and receives are done; return the received tensors."""
        for work in self._works:
            work.wait()
        self._works = []
        return self._received


def send_recv_next(tensors: list[torch.Tensor], group, async_op: bool = False):
    """Send `tensors` to group rank r+1 and receive same-shaped tensors from r-1 (a ring step).

    Returns the received list, or with `async_op=True` a `PendingExchange` (call `wait()` before reading
    the received tensors, and do not modify the sent ones until then). Every rank of the group must call
    it with tensors of the same shapes, in the same order.
    """
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tensors = [t.contiguous() for t in tensors]
    if world == 1:
        pending = PendingExchange([], tensors)
        return pending if async_op else pending.wait()
    dst = dist.get_global_rank(group, (rank + 1) % world)
    src = dist.get_global_rank(group, (rank - 1) % world)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, dst, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, src, group) for r in received]
    pending = PendingExchange(dist.batch_isend_irecv(ops), received)
    return pending if async_op else pending.wait()
