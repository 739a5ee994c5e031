"""Deterministic initial weights: every layout starts from exactly the weights one process would have.

    init_parameters(model, cfg, seed)      # model: a Llama, a pipeline chunk of one, sharded or not

A parameter's value is defined block by block: its rows (dim 0) are cut into blocks of about 2**20
elements (`rows_per_block`, from the shape alone), and block b comes from its own generator seeded by
(seed, canonical parameter name, b), on the CPU in float32 (the same numbers whatever the device). So
the value does not depend on which other parameters a rank holds, in which order they are visited or how
the parameter is sharded: one process, FSDP shards, tensor-parallel DTensors (2-D with FSDP included)
and pipeline chunks (which keep the `layers.N...` names) all compute the same numbers. A rank generates
only the blocks its shard overlaps (`shard_extent`: the block of the full tensor it holds), one at a
time, and keeps its part of each: it never holds a full tensor, and under FSDP it draws only its share
of the rows. The distribution: normal(0, init_std) for embeddings and linears, the residual outputs
(attention `wo`, MLP `w2`) scaled by 1/sqrt(2 * n_layers), RMSNorm weights 1.

Parameter names are compared without the segments wrappers insert (`canonical_name`); the checkpoint
code keys tensors by the same names and reads shards with `shard_extent` too.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fourfold.config import ModelConfig

# Path segments added by torch.compile, activation checkpointing and FSDP1-style wrappers.
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
BLOCK_ELEMENTS = 2**20  # elements per generated block of rows: part of the definition of the initial weights


def canonical_name(name: str) -> str:
    """A name without wrapper segments: layers.0._orig_mod.attention.wq.weight -> layers.0.attention.wq.weight."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def parameter_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit generator seed for row block `block` of parameter `name` under the run's `seed` (stable everywhere)."""
    digest = hashlib.sha256(f"{seed}/{canonical_name(name)}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows (dim-0 slices) per generated block of a tensor of `shape`: about 2**20 elements, at least one row."""
    row = math.prod(shape[1:])
    return max(1, BLOCK_ELEMENTS // max(1, row))


def shard_extent(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offset): this rank's part of `t` is the block full[offset : offset + local shape].

    A plain tensor is all of itself. For a DTensor, torch's own rule (the one torch.distributed.checkpoint
    uses) gives the block; with tensor parallel and FSDP both splitting dim 0 the shard is still one block.
    """
    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.dim()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(t.to_local().shape):
        raise RuntimeError(f"DTensor shard of shape {tuple(t.to_local().shape)} does not match torch's extent "
                           f"{tuple(shape)} for placements {t.placements}.")
    return tuple(shape), tuple(offset)


@torch.no_grad()
def fill_initial(dest: torch.Tensor, name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int,
                 offset: tuple[int, ...]) -> None:
    """Fill `dest` with full[offset : offset + dest.shape] of parameter `name` (full shape `shape`).

    Generates only the row blocks the extent overlaps, one at a time, on the CPU in float32, and copies
    each one's overlap into `dest` (any dtype or device); see the module docstring.
    """
    name = canonical_name(name)
    if name.endswith("norm.weight"):
        dest.fill_(1.0)
        return
    if name.endswith(".bias"):  # linear biases (attention_bias / mlp_bias) start at zero, as in Hugging Face
        dest.zero_()
        return
    if not shape:  # a scalar: one row of one element
        fill_initial(dest.view(1), name, (1,), cfg, seed, (0,))
        return
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight")):
        std = std / math.sqrt(2 * cfg.n_layers)
    first, last = offset[0], offset[0] + dest.shape[0]
    rows = rows_per_block(shape)
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], dest.shape[1:]))
    for block in range(first // rows, (last + rows - 1) // rows if dest.numel() else first // rows):
        start = block * rows
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name, block))
        values = torch.empty((min(rows, shape[0] - start), *shape[1:]), dtype=torch.float32, device="cpu")
        values.normal_(0.0, std, generator=generator)
        lo, hi = max(first, start), min(last, start + rows)
        dest[lo - first:hi - first] = values[(slice(lo - start, hi - start), *inner)]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for `t`: a DTensor's local shard, else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int | None = None) -> None:
    """Set every parameter of `model` not on the meta device to its initial value (this rank's shard of it).

    `seed` defaults to `torch.initial_seed()` (what the last `torch.manual_seed` set). Tied parameters
    appear once in `named_parameters()`, under the first name (the embedding), as in one process.
    """
    seed = torch.initial_seed() if seed is None else seed
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        _, offset = shard_extent(param)
        fill_initial(local_part(param), name, tuple(param.shape), cfg, seed, offset)
