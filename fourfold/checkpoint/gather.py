"""Saving without gathering: each block of each tensor travels from the rank that holds it to the writing rank.

    plan = gather_plan(tensors, shard_name, writer)   # collective: every rank says what it holds
    write_gathered(plan, path)     # on the writer: receive (or take) each block and write it at its place
    send_blocks(plan)              # elsewhere: send the blocks this rank was chosen for, in the same order

`tensors` maps each checkpoint name to what this rank holds of it: a DTensor (FSDP2, tensor parallel),
whose local shard is one block of the full tensor (`fourfold.models.init.shard_extent`), or a plain
tensor, which is all of it. Ranks with the same `shard_name` (one pipeline stage) write one file
through their writer. Where several ranks hold the same block (replicas across dp, tp-replicated norms,
DDP), the writer takes its own copy if it has one, else the lowest rank sends. The writer thus holds at
most one received block at a time beyond its own tensors; no rank ever assembles a full tensor it does
not already hold, and the other ranks only send. ZeRO-1 optimizer state is the same case: the owner
holds the whole tensor and sends it.

The plan's metadata (each rank's blocks: name, offset, shape, dtype) is all-gathered once per file;
that is small for the models here. The sharded, resharding checkpoint (torch.distributed.checkpoint) is
the checkpoint issue's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold.checkpoint.safetensors_io import SafetensorsWriter
from fourfold.errors import CheckpointError
from fourfold.models.init import local_part, shard_extent


@dataclass
class Block:
    """The part full[offset : offset + shape] of a tensor, sent by global rank `holder`."""

    holder: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class TensorPlan:
    """One tensor of the file: name, full shape and dtype, and the distinct blocks that tile it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: list[Block] = field(default_factory=list)


@dataclass
class GatherPlan:
    """What this rank does for one file: the tensors (same list on every rank of the stage), its own local
    parts by name, its global rank, the writer's global rank (None: nobody writes this stage) and the device
    blocks travel on."""

    tensors: list[TensorPlan]
    local: dict[str, torch.Tensor]
    me: int
    writer: int | None
    device: torch.device


def _comm_device() -> torch.device:
    """Where sent blocks must live: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _holdings(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """name -> (offset, local shape, full shape, dtype name) of what this rank holds."""
    out = {}
    for name, t in tensors.items():
        local_shape, offset = shard_extent(t)
        out[name] = (offset, local_shape, tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return out


def gather_plan(tensors: dict[str, torch.Tensor], shard_name: str, writer: bool) -> GatherPlan:
    """The plan for writing `tensors` (this rank's holdings) to the file of `shard_name` (collective)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = (shard_name, writer, _holdings(tensors))
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    stage = [(rank, w, held) for rank, (shard, w, held) in enumerate(everyone) if shard == shard_name]
    writers = [rank for rank, w, _ in stage if w]
    if len(writers) > 1:
        raise CheckpointError(f"Ranks {writers} all write checkpoint shard '{shard_name}'; exactly one may.")
    target = writers[0] if writers else None
    plans: dict[str, TensorPlan] = {}
    # the writer first, so that it takes blocks it holds itself; then the lowest rank holding a block sends it
    for rank, _, held in sorted(stage, key=lambda s: (s[0] != target, s[0])):
        for name, (offset, local_shape, shape, dtype) in held.items():
            plan = plans.setdefault(name, TensorPlan(name, shape, getattr(torch, dtype)))
            if math.prod(local_shape) and all((b.offset, b.shape) != (offset, local_shape) for b in plan.blocks):
                plan.blocks.append(Block(rank, offset, local_shape))
    for plan in plans.values():
        if sum(math.prod(b.shape) for b in plan.blocks) != math.prod(plan.shape):
            raise CheckpointError(f"The ranks' shards of '{plan.name}' do not tile its shape {list(plan.shape)}: "
                                  f"{[(b.offset, b.shape) for b in plan.blocks]}.")
    ordered = sorted(plans.values(), key=lambda p: p.name)
    return GatherPlan(ordered, {n: local_part(t) for n, t in tensors.items()}, me, target, _comm_device())


def write_gathered(plan: GatherPlan, path: Path) -> None:
    """On the writer: write every tensor of `plan` to the safetensors file `path`, one block at a time."""
    with SafetensorsWriter(path, [(t.name, t.shape, t.dtype) for t in plan.tensors]) as out:
        for tensor in plan.tensors:
            for block in tensor.blocks:
                if block.holder == plan.me:
                    data = plan.local[tensor.name]
                else:
                    data = torch.empty(block.shape, dtype=tensor.dtype, device=plan.device)
                    dist.recv(data, src=block.holder)
                out.write_block(tensor.name, block.offset, data)
                del data


def send_blocks(plan: GatherPlan) -> None:
    """On the other ranks: send each block this rank was chosen to provide, in the writer's order."""
    if plan.writer is None:
        return
    for tensor in plan.tensors:
        for block in tensor.blocks:
            if block.holder == plan.me:
                dist.send(plan.local[tensor.name].detach().to(plan.device).contiguous(), dst=plan.writer)
