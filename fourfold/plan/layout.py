"""The layout as the memory model sees it: which rank holds which parameter shards, mirrored from the code
that builds the layout (data-parallel strategy, tensor-parallel plan, pipeline split, FSDP2 and ZeRO-1 sharding)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fourfold.config import Config
from fourfold.layout import DIM_ORDER, grid_coordinates, layout_sizes
from fourfold.parallel.pipeline.split import stage_layer_counts


def rank_coordinates(cfg: Config, rank: int) -> dict[str, int]:
    """Coordinates of global `rank` in the (pp, dp, fsdp, cp, tp) grid, tp fastest (as fourfold.mesh)."""
    return grid_coordinates(layout_sizes(cfg), rank)


def rank_of(cfg: Config, coords: dict[str, int]) -> int:
    """The global rank at `coords` (missing dimensions are 0)."""
    sizes = layout_sizes(cfg)
    rank = 0
    for name in DIM_ORDER:
        rank = rank * sizes[name] + coords.get(name, 0)
    return rank


def fsdp_shard_group(cfg: Config, coords: dict[str, int]) -> tuple[int, int]:
    """(shard count, this rank's shard index) of FSDP2's shard dimension (`ParallelMesh.hsdp_mesh`).

    fsdp and cp form one flattened shard dimension (fsdp outer); with neither, FSDP (used because of tp)
    shards over dp. Under HSDP (dp and a shard dimension) dp only replicates.
    """
    sizes = layout_sizes(cfg)
    dims = [d for d in ("fsdp", "cp") if sizes[d] > 1]
    if not dims:
        return sizes["dp"], coords["dp"]
    size, index = 1, 0
    for d in dims:
        size *= sizes[d]
        index = index * sizes[d] + coords[d]
    return size, index


@dataclass(frozen=True)
class ParamShape:
    """One parameter as a rank holds it after tensor parallel and before data-parallel sharding."""

    name: str
    shape: tuple[int, ...]
    unit: int | None
    """The FSDP unit: the block index, or None for the chunk's root (embedding, final norm, head)."""

    @property
    def numel(self) -> int:
        """Elements of this (tensor-parallel local) parameter."""
        return math.prod(self.shape)

    @property
    def decays(self) -> bool:
        """In AdamW's decayed group (matrices and embeddings), as `fourfold.optim.decay_groups`."""
        return len(self.shape) >= 2

    @property
    def is_linear(self) -> bool:
        """A matmul weight that autocast casts (the embedding lookup is not autocast)."""
        return len(self.shape) == 2 and not self.name.endswith("tok_embeddings.weight")


def chunk_parameters(cfg: Config, layers: range, first: bool, last: bool) -> list[ParamShape]:
    """A model chunk's parameters in `named_parameters()` order, with tensor-parallel local shapes."""
    m, tp = cfg.model, cfg.parallel.tp
    d, hd = m.dim, m.head_dim
    q, kv, f, v = m.n_heads * hd // tp, m.n_kv_heads * hd // tp, m.ffn_dim // tp, m.vocab_size // tp
    out = []
    if first:
        out.append(ParamShape("tok_embeddings.weight", (v, d), None))
    for i in layers:
        for name, shape in (("attention_norm.weight", (d,)), ("attention.wq.weight", (q, d)),
                            ("attention.wk.weight", (kv, d)), ("attention.wv.weight", (kv, d)),
                            ("attention.wo.weight", (d, q)), ("ffn_norm.weight", (d,)),
                            ("feed_forward.w1.weight", (f, d)), ("feed_forward.w3.weight", (f, d)),
                            ("feed_forward.w2.weight", (d, f))):
            out.append(ParamShape(f"layers.{i}.{name}", shape, i))
    if last:
        out.append(ParamShape("norm.weight", (d,), None))
        if not (m.tie_embeddings and first):  # tied: the head is the embedding, counted once
            out.append(ParamShape("output.weight", (v, d), None))
    return out


def rank_chunks(cfg: Config, pp_rank: int) -> list[tuple[range, bool, bool]]:
    """(layers, has embedding, has head) for each pipeline chunk of `pp_rank` (chunk c is stage c * pp + r)."""
    p = cfg.parallel
    counts = stage_layer_counts(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers)
    chunks = []
    for c in range(p.vpp):
        stage = c * p.pp + pp_rank
        start = sum(counts[:stage])
        chunks.append((range(start, start + counts[stage]), stage == 0, stage == len(counts) - 1))
    return chunks


def fsdp_rows(dim0: int, shards: int, index: int) -> tuple[int, int]:
    """(stored rows, local rows) of shard `index` of a dim-0 size `dim0` split `shards` ways by FSDP2.

    Every shard is stored padded to ceil(dim0 / shards) rows; the local (unpadded) shard is what is left
    of dim0 after the earlier shards, torch.chunk-style (possibly empty).
    """
    rows = -(-dim0 // shards)
    return rows, max(0, min(rows, dim0 - index * rows))


def zero1_partition(params: list[ParamShape], world: int) -> list[int]:
    """The rank ZeroRedundancyOptimizer assigns each parameter to (its greedy, largest-first partition).

    Parameter groups in order (decayed, then not decayed); within a group, parameters sorted by size,
    largest first (stable); each goes to the rank with the fewest elements so far (lowest index on ties).
    """
    sizes = [0] * world
    owner = [0] * len(params)
    for decays in (True, False):
        group = [i for i, prm in enumerate(params) if prm.decays == decays]
        for i in sorted(group, key=lambda j: params[j].numel, reverse=True):
            rank = sizes.index(min(sizes))
            owner[i] = rank
            sizes[rank] += params[i].numel
    return owner
