"""Apply a layout to a model: fake quant (QAT), tensor/sequence parallel, context parallel, float8, recomputation, compile, data parallel.

    model = apply_model_transforms(model, mesh, cfg.parallel, cfg.compute, cfg.quant, device)  # steps 0-5
    model = dp.wrap(model)                                                                   # step 6

The order matters, and is the one torchtitan uses (plus step 0):
0. Quantization-aware training (quant.qat) swaps the linears for fake-quant ones first. The swap keeps
   module paths and parameters, so the TP plan (by path) applies to the fake-quant linears exactly as to
   plain ones and registers its input/output hooks on them; swapped after TP, the new modules would lack
   those hooks. Under TP each weight shard is fake-quantized locally (no communication), which equals one
   process only when no group straddles a shard boundary: prepare_qat checks that against the tp size.
   Recomputation and compile then see the fake-quant ops, and FSDP shards the (unchanged) parameters
   and hands them back whole to each forward.
1. Tensor (and sequence) parallel before the others: it replaces weights with DTensors sharded on the tp mesh;
   everything after sees the sharded weights.
2. Context parallel swaps the attention core; it must precede recomputation so the ring attention is
   inside the recomputed region like the core it replaces.
3. float8 (quant.float8) swaps the block linears for torchao's float8 ones, so recomputation and compile
   see the float8 matmuls.
4. Activation recomputation wraps blocks (or ops) before compile, so compile traces the checkpointed
   region and can fuse the recomputation.
5. torch.compile per block (regional): short compile time, and each block is compiled once and reused;
   or, with compute.compile_scope "model", of the whole forward (one GPU or DDP only).
6. Data parallel last: FSDP's fully_shard shards whatever parameters the earlier steps left (DTensors
   on the tp mesh included), and its hooks go around the compiled blocks.

Steps 0-5 and FSDP's step 6 work on a model on the meta device (shapes, no storage);
`fourfold.parallel.build` materialises only this rank's shards after them, and before step 6 for DDP and
ZeRO-1, which need real tensors (`DataParallel.wraps_meta_models`).
"""

from __future__ import annotations

from torch import nn

from fourfold.config import ComputeConfig, ParallelConfig, QuantConfig
from fourfold.mesh import ParallelMesh
from fourfold.parallel.context import apply_context_parallel
from fourfold.parallel.tensor import apply_tensor_parallel
from fourfold.quant.float8 import apply_float8
from fourfold.quant.qat import prepare_qat
from fourfold.recompute import apply_recompute


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each transformer block in place (regional compilation; parameter names unchanged)."""
    for block in model.layers.values():
        block.compile()


def apply_model_transforms(model: nn.Module, mesh: ParallelMesh, parallel: ParallelConfig, compute: ComputeConfig,
                           quant: QuantConfig, device) -> nn.Module:
    """Steps 0-5 of the module docstring on `model` (one pipeline chunk or the whole model), in place.

    `device` is where the model will run (float8 checks its GPU); the model itself may still be on meta.
    """
    if quant.qat is not None:
        prepare_qat(model, quant.qat, embeddings=quant.embeddings, output=quant.output, tp=mesh.size("tp"))
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh.get("tp"), parallel.sequence_parallel)
    if mesh.size("cp") > 1:
        apply_context_parallel(model, mesh.get("cp"), parallel.cp_method)
    if quant.float8:
        apply_float8(model, device)
    if compute.recompute != "none":
        apply_recompute(model, compute.recompute)
    if compute.compile and compute.compile_memory_budget < 1:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = compute.compile_memory_budget
    if compute.compile and compute.compile_scope == "model":
        model.compile()  # one graph from tokens to logits (validate_layout allows it only on one GPU or DDP)
    elif compute.compile:
        compile_blocks(model)
    return model

