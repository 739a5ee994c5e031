"""Build the model a rank trains: the Llama of the config, split into this rank's pipeline chunks, with every
parallel dimension applied (`fourfold.parallel.apply`), holding only this rank's shards.

    chunks = build_model(cfg.model, cfg.parallel, cfg.compute, cfg.quant, mesh, dp, device, seed=cfg.train.seed)
    # -> [model] without pipeline parallel, else this rank's chunks

The model is built on the meta device (shapes, no storage), split into pipeline stages and transformed
there (tensor and context parallel, float8, recomputation, compile, FSDP2's sharding); then each rank
allocates only what it holds (`to_empty` on its device) and fills it (`Llama.init_weights`), so no rank
ever holds the whole model (DDP and ZeRO-1 hold whole parameters by design: they are materialised just
before their wrap, which needs real tensors). Every rank starts from the weights a single process would
have, whatever its layout: each parameter's value comes from generators seeded by (seed, parameter
name, row block), and a rank generates only the blocks its shard overlaps (`fourfold.models.init`).
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.config import ComputeConfig, ModelConfig, ParallelConfig, QuantConfig
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.parallel.apply import apply_model_transforms
from fourfold.parallel.data_parallel import DataParallel
from fourfold.parallel.pipeline import split_pipeline
from fourfold.precision import master_dtype


def materialize(chunk: Llama, model_cfg: ModelConfig, param_device: torch.device, device: torch.device,
                seed: int) -> None:
    """Give a meta-device Llama (chunk) storage for what this rank holds, then its initial values, in place.

    Parameters go to `param_device` (the CPU under FSDP's cpu_offload), the rotary tables to `device`.
    """
    chunk.to_empty(device=param_device)
    if param_device != device:
        chunk.rope_cos, chunk.rope_sin = chunk.rope_cos.to(device), chunk.rope_sin.to(device)
    has_both = chunk.tok_embeddings is not None and chunk.output is not None
    if model_cfg.tie_embeddings and has_both and chunk.output.weight is not chunk.tok_embeddings.weight:
        chunk.output.weight = chunk.tok_embeddings.weight  # to_empty replaced the shared parameter per module
    chunk.init_weights(seed)


def build_model(model_cfg: ModelConfig, parallel: ParallelConfig, compute: ComputeConfig, quant: QuantConfig,
                mesh: ParallelMesh, dp: DataParallel, device: torch.device, *,
                seed: int | None = None) -> list[nn.Module]:
    """This rank's model chunks (one chunk unless pp > 1), parallelized and on `device` in the master dtype.

    `seed` (default `torch.initial_seed()`, which the trainer sets from train.seed) picks the initial weights.
    """
    seed = torch.initial_seed() if seed is None else seed
    with torch.device("meta"):
        model = Llama(model_cfg)
    model.to(dtype=master_dtype(compute.precision))
    if mesh.size("pp") > 1:
        chunks = split_pipeline(model, mesh.coord("pp"), mesh.size("pp"), parallel.vpp, parallel.pp_layers)
    else:
        chunks = [model]
    built = []
    for chunk in chunks:
        chunk = apply_model_transforms(chunk, mesh, parallel, compute, quant, device)
        if dp.wraps_meta_models:
            chunk = dp.wrap(chunk)
            materialize(chunk, model_cfg, dp.parameter_device, device, seed)
        else:
            materialize(chunk, model_cfg, dp.parameter_device, device, seed)
            chunk = dp.wrap(chunk)
        built.append(chunk)
    return built
