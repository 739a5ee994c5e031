"""Split a Llama into pipeline stages: each pp rank gets `vpp` chunks, each a Llama holding only its blocks.

    chunks = split_pipeline(model, pp_rank=1, pp=2, vpp=2)      # global stages 1 and 3 of 4
    chunks[0].layers.keys()                                     # e.g. ['2', '3'] for 8 layers

Chunk c of pp-rank r is global stage `c * pp + r`. Blocks keep their original indices (so parameter
names such as `layers.5.attention.wq.weight` match the unsplit model and checkpoints reshard by
name); `tok_embeddings` lives only on global stage 0 and `norm` / `output` only on the last stage,
elsewhere they are None and the model's forward passes hidden states through.

`fourfold.parallel.build` splits the model while it is on the meta device, so the copies hold no storage;
each rank then materialises only its own chunks (and within them only its shards).
"""

from __future__ import annotations

import copy

from torch import nn

from fourfold.errors import LayoutError


def stage_layer_counts(n_layers: int, pp: int, vpp: int = 1, layers_per_stage: list[int] | None = None) -> list[int]:
    """Blocks per global stage (pp * vpp entries): an even split, or `layers_per_stage` after checking it."""
    stages = pp * vpp
    if layers_per_stage is None:
        if n_layers % stages:
            raise LayoutError(
                f"model.n_layers ({n_layers}) does not split evenly over pp * vpp = {stages} pipeline stages; "
                f"pass the blocks per stage as parallel.pp_layers (a list of {stages} numbers summing to "
                f"{n_layers}) or change parallel.pp / parallel.vpp."
            )
        return [n_layers // stages] * stages
    counts = list(layers_per_stage)
    if len(counts) != stages or sum(counts) != n_layers or any(int(c) != c or c < 1 for c in counts):
        raise LayoutError(
            f"parallel.pp_layers {counts} must have pp * vpp = {stages} positive whole entries summing to "
            f"model.n_layers ({n_layers})."
        )
    return [int(c) for c in counts]


def stage_layers(n_layers: int, pp: int, vpp: int, stage: int, layers_per_stage: list[int] | None = None) -> range:
    """Indices of the blocks global stage `stage` holds."""
    counts = stage_layer_counts(n_layers, pp, vpp, layers_per_stage)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def split_pipeline(model: nn.Module, pp_rank: int, pp: int, vpp: int = 1,
                   layers_per_stage: list[int] | None = None) -> list[nn.Module]:
    """This rank's `vpp` chunks of `model` (a fourfold Llama, on the meta device or not), copied so `model`
    itself is left whole.

    Only what a chunk keeps is copied: the other blocks, and the embedding / final norm / head where
    the chunk does not own them, are replaced by None during the deep copy (memory stays one stage's).
    """
    if not 0 <= pp_rank < pp:
        raise LayoutError(f"pp rank {pp_rank} is outside 0..{pp - 1}.")
    n_layers = len(model.layers)
    last = pp * vpp - 1
    chunks = []
    for chunk_index in range(vpp):
        stage = chunk_index * pp + pp_rank
        keep = {str(i) for i in stage_layers(n_layers, pp, vpp, stage, layers_per_stage)}
        dropped = [block for name, block in model.layers.items() if name not in keep]
        if stage != 0:
            dropped.append(model.tok_embeddings)
        if stage != last:
            dropped += [model.norm, model.output]
        memo = {id(m): None for m in dropped if m is not None}
        chunk = copy.deepcopy(model, memo)
        for name in [n for n, block in chunk.layers._modules.items() if block is None]:
            del chunk.layers[name]
        chunks.append(chunk)
    return chunks
