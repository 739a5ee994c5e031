"""Build the model a rank trains: the Llama of the config, split into this rank's pipeline chunks, with every
parallel dimension applied (`fourfold.parallel.apply.parallelize`).

    chunks = build_model(cfg.model, cfg.parallel, cfg.compute, cfg.quant, mesh, dp, device)
    # -> [model] without pipeline parallel, else this rank's chunks

Every rank starts from the same weights a single process would have, whatever its layout.
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.config import ComputeConfig, ModelConfig, ParallelConfig, QuantConfig
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.parallel.apply import parallelize
from fourfold.parallel.data_parallel import DataParallel
from fourfold.parallel.pipeline import split_pipeline
from fourfold.precision import master_dtype


def build_model(model_cfg: ModelConfig, parallel: ParallelConfig, compute: ComputeConfig, quant: QuantConfig,
                mesh: ParallelMesh, dp: DataParallel, device: torch.device) -> list[nn.Module]:
    """This rank's model chunks (one chunk unless pp > 1), parallelized and on `device` in the master dtype."""
    model = Llama(model_cfg)  # same seed on every rank: identical initial weights before sharding
    model.to(device, master_dtype(compute.precision))
    if mesh.size("pp") > 1:
        chunks = split_pipeline(model, mesh.coord("pp"), mesh.size("pp"), parallel.vpp, parallel.pp_layers)
    else:
        chunks = [model]
    return [parallelize(chunk, mesh, parallel, compute, quant, dp) for chunk in chunks]
