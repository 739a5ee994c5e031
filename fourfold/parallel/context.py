"""Context parallelism: each rank holds a slice of every sequence; attention sees the whole sequence.

    apply_context_parallel(model, mesh.get("cp"), method="ring")        # swaps each block's attention core
    inputs, targets, positions = shard_batch(inputs, targets, cp_rank, cp)
    logits = model(inputs, positions)                                   # local tokens, global positions

Load balance: the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r, so under the
causal mask every rank does the same attention work. Everything but attention is per token and needs
no change; gradients of the (replicated) parameters are reduced over cp like data parallel.

Two attention cores (torch's own `context_parallel` has no CPU path, so these are ours):
- `ring`: K/V blocks travel around the ring (cp - 1 shifts, differentiable: gradients travel back);
  each block's attention is computed with its log-sum-exp and the partial results are merged exactly
  (online softmax). Block pairs that the causal mask empties are skipped. Memory per block is
  (seq/cp)^2 scores per head.
- `allgather`: K and V are all-gathered once (backward: reduce-scatter), and each local chunk attends
  to the keys before it through SDPA's memory-efficient kernel with a causal mask at its offset.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourfold.parallel.comm import all_gather_along, ring_shift


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices (of 2*cp) that rank `cp_rank` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's load-balanced slice of `x` along `dim` (chunks r and 2cp-1-r, concatenated)."""
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def positions_for(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions of the local tokens (for rotary embeddings and masks)."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp_rank, cp)


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, cp_rank: int, cp: int):
    """(inputs, targets, positions) of this rank's slice of every sequence in the batch."""
    positions = positions_for(inputs.shape[1], cp_rank, cp, inputs.device)
    return shard_sequence(inputs, 1, cp_rank, cp), shard_sequence(targets, 1, cp_rank, cp), positions


def unshard_sequence(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Reassemble the full sequence from every rank's load-balanced slice (tests, evaluation)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    chunks: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = chunk_ids(r, cp)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _group_of(mesh_or_group):
    return mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group


def _block_attention(q, k, v, q_pos, k_pos):
    """Masked attention of q (b, h, Lq, d) to k, v (b, h, Lk, d): (output, log-sum-exp (b, h, Lq))."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) * scale
    scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])  # rows with no visible key give zeros
    return (probs @ v.to(wide)), lse


class RingAttentionCore(nn.Module):
    """Exact causal attention over a sequence split across the cp group, K/V passed around the ring."""

    def __init__(self, group):
        super().__init__()
        self.group = _group_of(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        seq = q.shape[2] * cp
        q_ids = chunk_ids(rank, cp)
        q_chunks = q.chunk(2, dim=2)
        q_pos_chunks = positions_for(seq, rank, cp, q.device).chunk(2)
        outs: list[list] = [[], []]
        lses: list[list] = [[], []]
        for step in range(cp):
            owner = (rank - step) % cp
            k_ids = chunk_ids(owner, cp)
            k_pos_chunks = positions_for(seq, owner, cp, q.device).chunk(2)
            k_chunks, v_chunks = k.chunk(2, dim=2), v.chunk(2, dim=2)
            for i in range(2):
                for j in range(2):
                    if k_ids[j] > q_ids[i]:
                        continue  # every key is after every query: masked out entirely
                    o, lse = _block_attention(q_chunks[i], k_chunks[j], v_chunks[j], q_pos_chunks[i], k_pos_chunks[j])
                    outs[i].append(o)
                    lses[i].append(lse)
            if step < cp - 1:
                k, v = ring_shift([k, v], self.group)
        merged = []
        for i in range(2):
            lse = torch.stack(lses[i]).logsumexp(dim=0)
            merged.append(sum(o * torch.exp(l - lse)[..., None] for o, l in zip(outs[i], lses[i])))
        return torch.cat(merged, dim=2).to(q.dtype)


class AllGatherAttentionCore(nn.Module):
    """Causal attention after all-gathering K and V over the cp group (backward reduce-scatters dK, dV)."""

    def __init__(self, group):
        super().__init__()
        self.group = _group_of(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        k_all, v_all = (self._global_order(all_gather_along(t, 2, self.group), cp) for t in (k, v))
        chunk = q.shape[2] // 2
        outs = []
        for i, c in enumerate(chunk_ids(rank, cp)):
            end = (c + 1) * chunk  # keys up to the end of this query chunk
            qc = q[:, :, i * chunk:(i + 1) * chunk]
            q_pos = torch.arange(c * chunk, end, device=q.device)
            k_pos = torch.arange(end, device=q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
            outs.append(F.scaled_dot_product_attention(qc, k_all[:, :, :end], v_all[:, :, :end], attn_mask=mask,
                                                       enable_gqa=k.shape[1] != q.shape[1]))
        return torch.cat(outs, dim=2)

    @staticmethod
    def _global_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
        """Rank-ordered [r0 chunks a,b | r1 chunks a,b | ...] -> chunks 0 .. 2cp-1 in sequence order."""
        pieces = gathered.chunk(2 * cp, dim=2)
        order: list = [None] * (2 * cp)
        for r in range(cp):
            a, b = chunk_ids(r, cp)
            order[a], order[b] = pieces[2 * r], pieces[2 * r + 1]
        return torch.cat(order, dim=2)


def apply_context_parallel(model: nn.Module, cp_mesh_or_group, method: str = "ring") -> nn.Module:
    """Replace every block's attention core with the context-parallel one, in place."""
    core_cls = {"ring": RingAttentionCore, "allgather": AllGatherAttentionCore}[method]
    for block in model.layers.values():
        block.attention.core = core_cls(cp_mesh_or_group)
    return model
