"""Context parallelism: each rank holds a slice of every sequence; attention still sees the whole sequence.

    apply_context_parallel(model, mesh.get("cp"), method="ring")     # swaps each block's attention core
    inputs, targets, positions = shard_batch(inputs, targets, cp_rank, cp)
    logits = model(inputs, positions)                                # local tokens, absolute positions
    loss = cross_entropy(logits, targets)                            # mean over local tokens; reduce
                                                                     # grads (and the loss) over cp like dp

Load balance: the sequence is cut into 2*cp equal chunks and rank r holds chunks r and 2cp-1-r, so
under the causal mask every rank does the same attention work. Everything but attention is per token
and needs no change; the (replicated) parameters' gradients are averaged over cp like data parallel.

Two attention cores (torch's own `context_parallel` has no CPU path, so these are ours):
- `ring` (RingAttentionCore, fourfold/parallel/ring_attention.py): K/V blocks travel around the ring,
  cp-1 hops overlapped with compute, partial results merged exactly by log-sum-exp; the backward sends
  dK/dV around the ring. Memory per hop: one (s/cp)^2 score block per head.
- `allgather` (AllGatherAttentionCore): K and V are all-gathered once (backward: reduce-scatter of
  dK, dV) and the local queries attend with the causal mask at their absolute positions. Simpler,
  one collective per layer, but every rank holds the whole sequence's K/V.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourfold.config import check_value
from fourfold.errors import LayoutError
from fourfold.parallel.comm import all_gather_along
from fourfold.parallel.ring_attention import ring_attention


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices (of 2*cp) that rank `cp_rank` holds, in increasing order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def check_sequence_split(seq_len: int, cp: int) -> None:
    """Context parallel's rule (fourfold.layout runs it before any group): 2*cp equal chunks per sequence."""
    if seq_len % (2 * cp):
        raise LayoutError(f"Context parallel cuts each sequence into 2*cp = {2 * cp} equal chunks (load balance), "
                          f"but the sequence has {seq_len} positions; make train.seq_len a multiple of {2 * cp} "
                          "or change parallel.cp.")


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's load-balanced slice of `x` along `dim`: chunks r and 2cp-1-r of 2*cp, concatenated."""
    check_sequence_split(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def positions_for(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions (LongTensor of seq_len / cp) of this rank's tokens, for rotary embeddings."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp_rank, cp)


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, cp_rank: int, cp: int):
    """(inputs, targets, positions): this rank's slice of every (batch, seq) sequence, and its positions."""
    positions = positions_for(inputs.shape[1], cp_rank, cp, inputs.device)
    return shard_sequence(inputs, 1, cp_rank, cp), shard_sequence(targets, 1, cp_rank, cp), positions


def to_global_order(gathered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Rank-ordered slices [r0: chunks 0, 2cp-1 | r1: chunks 1, 2cp-2 | ...] -> chunks 0 .. 2cp-1 in order."""
    pieces = gathered.chunk(2 * cp, dim=dim)
    ordered: list = [None] * (2 * cp)
    for rank in range(cp):
        first, second = chunk_ids(rank, cp)
        ordered[first], ordered[second] = pieces[2 * rank], pieces[2 * rank + 1]
    return torch.cat(ordered, dim=dim)


def unshard_sequence(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full sequence from every rank's load-balanced slice along `dim` (differentiable; tests, eval)."""
    group = _group_of(group)
    return to_global_order(all_gather_along(local, dim, group), dim, dist.get_world_size(group))


def _group_of(mesh_or_group):
    """A ProcessGroup from a 1-D DeviceMesh or a ProcessGroup (None: the default group)."""
    if mesh_or_group is None:
        return dist.group.WORLD
    if hasattr(mesh_or_group, "get_group"):
        if mesh_or_group.ndim != 1:
            raise LayoutError(f"Context parallel needs the 1-D cp mesh (mesh.get('cp')), got a {mesh_or_group.ndim}-D "
                              f"mesh with dimensions {mesh_or_group.mesh_dim_names}.")
        return mesh_or_group.get_group()
    return mesh_or_group


class RingAttentionCore(nn.Module):
    """Exact causal attention over a sequence split across the cp group, K/V passed around the ring.

    Drop-in for `CausalAttentionCore`: forward(q (b, hq, s_local, d), k/v (b, hkv, s_local, d)) with the
    local tokens in the load-balanced layout of `shard_sequence`.
    """

    def __init__(self, group):
        super().__init__()
        self.group = _group_of(group)
        self.cp_rank, self.cp = dist.get_rank(self.group), dist.get_world_size(self.group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention output (b, hq, s_local, d) of the local queries over the whole sequence."""
        return ring_attention(q, k, v, self.group, self.cp_rank, self.cp)


class AllGatherAttentionCore(nn.Module):
    """Causal attention after all-gathering K and V over the cp group (backward reduce-scatters dK, dV)."""

    def __init__(self, group):
        super().__init__()
        self.group = _group_of(group)
        self.cp_rank, self.cp = dist.get_rank(self.group), dist.get_world_size(self.group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention output (b, hq, s_local, d) of the local queries over the whole sequence."""
        k_all = to_global_order(all_gather_along(k, 2, self.group), 2, self.cp)
        v_all = to_global_order(all_gather_along(v, 2, self.group), 2, self.cp)
        chunk = q.shape[2] // 2
        outs = []
        for i, chunk_id in enumerate(chunk_ids(self.cp_rank, self.cp)):
            # This chunk's queries see every key up to the end of the chunk; causal within the chunk.
            end = (chunk_id + 1) * chunk
            q_pos = torch.arange(end - chunk, end, device=q.device)
            k_pos = torch.arange(end, device=q.device)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * chunk:(i + 1) * chunk], k_all[:, :, :end], v_all[:, :, :end],
                attn_mask=q_pos[:, None] >= k_pos[None, :], enable_gqa=k.shape[1] != q.shape[1]))
        return torch.cat(outs, dim=2)


CORES = {"ring": RingAttentionCore, "allgather": AllGatherAttentionCore}


def apply_context_parallel(model: nn.Module, cp_mesh_or_group, method: str = "ring") -> nn.Module:
    """Replace every block's `attention.core` with the context-parallel core `method`, in place.

    `cp_mesh_or_group` is the 1-D cp DeviceMesh (`mesh.get("cp")`) or a ProcessGroup; None (what
    `mesh.get("cp")` returns when cp == 1) leaves the model unchanged. Works on a whole model or a
    pipeline chunk (whatever blocks `model.layers` holds). Returns `model`.
    """
    check_value("parallel.cp_method", method)  # the config's one rule for this setting
    if cp_mesh_or_group is None:
        return model
    group = _group_of(cp_mesh_or_group)
    for block in model.layers.values():
        block.attention.core = CORES[method](group)
    return model
