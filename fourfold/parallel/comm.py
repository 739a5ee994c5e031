"""The few collectives fourfold writes itself, as autograd functions whose backward is the dual collective.

    all_gather_along(x, dim, group)      forward all-gather along dim     backward reduce-scatter along dim
    reduce_scatter_along(x, dim, group)  forward reduce-scatter along dim backward all-gather along dim
    all_reduce_sum(x, group)             forward all-reduce (sum)         backward identity
    copy_to_group(x, group)              forward identity                 backward all-reduce (sum)
    send_recv_next(tensors, group)       send to group rank r+1, receive from r-1 (not differentiable)

The gradient conventions are the usual ones: `all_reduce_sum` and `copy_to_group` are a pair (a tensor
replicated over the group enters through `copy_to_group`, per-rank partial results leave through
`all_reduce_sum`, and the loss downstream is then the same on every rank); `all_gather_along` and
`reduce_scatter_along` treat each rank's loss as one term of a sum over ranks.

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
    """The sum of every rank's `x`, cut into world equal slices along `dim`; this rank's slice."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"reduce-scatter along dim {dim} needs its size ({x.shape[dim]}) divisible by {world}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    try:
        _reduce_scatter_single(out, front, group=group)
    except (RuntimeError, NotImplementedError):
        # Some gloo builds have no reduce-scatter (for some dtypes or torch versions); the check fails
        # before any data moves, so fall back to all-reduce + slice: same sum, world times the bytes.
        if dist.get_backend(group) != "gloo":
            raise
        summed = front.clone()
        dist.all_reduce(summed, group=group)
        out = summed[rank * out.shape[0]:(rank + 1) * out.shape[0]]
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


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        """`x` summed over the group; this rank's slice along `dim`."""
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        """The gradient all-gathered along `dim`."""
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """`x` summed over the group, in a new tensor."""
        out = x.clone()  # never reduce into the caller's tensor
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        """The gradient unchanged."""
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """`x` unchanged (a view)."""
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        """The gradient summed over the group."""
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in group-rank order (backward: reduce-scatter the grad)."""
    return _AllGatherAlong.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's slice along `dim` (backward: all-gather the grad)."""
    return _ReduceScatterAlong.apply(x, dim, group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the group (backward: identity, since the downstream grad is already replicated)."""
    return _AllReduceSum.apply(x, group)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity on a tensor replicated over the group (backward: sum every rank's grad)."""
    return _CopyToGroup.apply(x, group)


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
