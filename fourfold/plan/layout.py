"""The layout as the memory model sees it: which parameter shards each rank holds, derived from the code that
builds the layout rather than re-listed.

Parameter names, shapes and order come from the model itself, built on the meta device (no memory, even
for 405B); pipeline chunks from `fourfold.parallel.pipeline.split.split_pipeline` applied to that model;
tensor-parallel shapes from the plan `fourfold.parallel.tensor_plan` (which module is column-, row- or
vocab-parallel) and the dimension each torch ParallelStyle shards. What is replayed here is torch's own
arithmetic: FSDP2's padded dim-0 shards and ZeroRedundancyOptimizer's greedy partition.

    chunks = rank_chunks(cfg, pp_rank)      # [Chunk(layers, first, last, params), ...] for this pp rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from fourfold.config import Config, ModelConfig
from fourfold.layout import DIM_ORDER, grid_coordinates, layout_sizes
from fourfold.models.llama import Llama
from fourfold.parallel.pipeline.split import split_pipeline
from fourfold.parallel.tensor_plan import block_plan, outer_plan


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
    is_linear: bool = False
    """Owned by an nn.Linear: a matmul weight that autocast casts (the embedding lookup is not autocast)."""

    @property
    def numel(self) -> int:
        """Elements of this (tensor-parallel local) parameter."""
        return math.prod(self.shape)

    @property
    def decays(self) -> bool:
        """In AdamW's decayed group (matrices and embeddings), as `fourfold.optim.decay_groups`."""
        return len(self.shape) >= 2


@dataclass(frozen=True)
class Chunk:
    """One model chunk a pipeline rank holds: its blocks, whether it has the embedding / the head, its parameters."""

    layers: range
    first: bool
    last: bool
    params: list[ParamShape]


_META_MODELS: dict[str, Llama] = {}
"""A few meta models by the repr of their ModelConfig: a layout search plans many layouts of one model."""


def meta_model(model_cfg: ModelConfig) -> Llama:
    """The whole model on the meta device: every parameter's name, shape and module, no storage. Do not modify it."""
    key = repr(model_cfg)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= 4:
            _META_MODELS.pop(next(iter(_META_MODELS)))
        with torch.device("meta"):
            _META_MODELS[key] = Llama(model_cfg)
    return _META_MODELS[key]


def style_shard_dim(style: ParallelStyle, module: nn.Module, param_name: str) -> int | None:
    """The dimension torch's ParallelStyle shards `module`'s parameter along, or None when it stays replicated.

    Column-parallel: a linear's weight and bias by output rows (dim 0), an embedding by columns (dim 1).
    Row-parallel: a linear's weight by input columns (dim 1, bias replicated), an embedding by rows (dim 0).
    Other styles (SequenceParallel, PrepareModuleInput) leave parameters replicated.
    """
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return 1 if embedding else 0
    if isinstance(style, RowwiseParallel):
        if embedding:
            return 0
        return 1 if param_name == "weight" else None
    return None


def tensor_parallel_dims(chunk: nn.Module, sequence_parallel: bool) -> dict[int, int]:
    """id(parameter) -> the dimension tensor parallel splits it along, from the plan `apply_tensor_parallel` applies."""
    placed: list[tuple[nn.Module, dict]] = [
        (chunk, outer_plan(sequence_parallel, chunk.tok_embeddings is not None, chunk.output is not None))]
    placed += [(block, block_plan(sequence_parallel)) for block in chunk.layers.values()]
    dims: dict[int, int] = {}
    for root, plan in placed:
        for path, style in plan.items():
            module = root.get_submodule(path)
            for name, prm in module.named_parameters(recurse=False):
                dim = style_shard_dim(style, module, name)
                if dim is None:
                    continue
                if dims.setdefault(id(prm), dim) != dim:  # a tied weight must be split the same way twice
                    raise ValueError(f"{path}.{name} is split along dims {dims[id(prm)]} and {dim} by the tensor plan.")
    return dims


def chunk_parameters(chunk: nn.Module, tp: int, sequence_parallel: bool) -> list[ParamShape]:
    """A (meta) model chunk's parameters in `named_parameters()` order, with their tensor-parallel local shapes."""
    dims = tensor_parallel_dims(chunk, sequence_parallel) if tp > 1 else {}
    unit_of = {id(prm): int(key) for key, block in chunk.layers.items() for prm in block.parameters()}
    owner: dict[int, nn.Module] = {}
    for module in chunk.modules():  # a tied weight belongs to the first module that holds it: the embedding
        for prm in module.parameters(recurse=False):
            owner.setdefault(id(prm), module)
    out = []
    for name, prm in chunk.named_parameters():
        shape = list(prm.shape)
        dim = dims.get(id(prm))
        if dim is not None:
            assert shape[dim] % tp == 0, f"{name}: dim {dim} ({shape[dim]}) does not divide by tp={tp}"
            shape[dim] //= tp
        out.append(ParamShape(name, tuple(shape), unit_of.get(id(prm)), isinstance(owner[id(prm)], nn.Linear)))
    return out


_CHUNKS: dict[tuple, list[Chunk]] = {}
"""rank_chunks' answers by everything they depend on: a layout search asks for the same split many times."""


def rank_chunks(cfg: Config, pp_rank: int) -> list[Chunk]:
    """The chunks pipeline rank `pp_rank` holds (chunk c is stage c * pp + pp_rank), as `build_model` splits them.

    Do not modify the result: it is shared with later calls for the same model and split."""
    p = cfg.parallel
    key = (repr(cfg.model), p.pp, p.vpp, tuple(p.pp_layers or ()), p.tp, p.sequence_parallel, pp_rank)
    if key not in _CHUNKS:
        if len(_CHUNKS) >= 512:
            _CHUNKS.pop(next(iter(_CHUNKS)))
        _CHUNKS[key] = _rank_chunks(cfg, pp_rank)
    return _CHUNKS[key]


def _rank_chunks(cfg: Config, pp_rank: int) -> list[Chunk]:
    p = cfg.parallel
    model = meta_model(cfg.model)
    modules = split_pipeline(model, pp_rank, p.pp, p.vpp, p.pp_layers) if p.pp > 1 else [model]
    if len(model.layers) != cfg.model.n_layers or model.tok_embeddings is None or model.output is None:
        _META_MODELS.pop(repr(cfg.model))  # a split that takes blocks out of its input: build afresh next time
    chunks = []
    for module in modules:
        indices = [int(key) for key in module.layers.keys()]
        layers = range(indices[0], indices[-1] + 1) if indices else range(0)
        assert list(layers) == indices, f"pipeline chunk holds non-contiguous blocks {indices}"
        chunks.append(Chunk(layers, module.tok_embeddings is not None, module.output is not None,
                            chunk_parameters(module, p.tp, p.sequence_parallel)))
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
