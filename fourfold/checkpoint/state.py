"""Model and optimizer state by canonical parameter name: what this rank holds, and loading it back from files.

Saving: `model_tensors` and `optimizer_tensors` name what this rank holds (DTensor shards stay sharded;
ZeRO-1 ranks list only the state of the parameters they own); `fourfold.checkpoint.gather` moves each
block to the writing rank. Loading: each rank reads from the files only the block of each tensor it
holds (`TensorReader.get_block` at `fourfold.models.init.shard_extent`), one tensor at a time.

Names are canonical (wrapper segments such as torch.compile's `_orig_mod.` and DDP's `module.` removed),
so they match across layouts; pipeline chunks (a list of modules) are viewed as one module with the
original Llama names. On disk optimizer tensors are keyed `state.<param>.<key>` (exp_avg, exp_avg_sq,
step), their param groups (hyper-parameters, parameter names) are JSON.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fourfold.checkpoint.safetensors_io import TensorReader
from fourfold.errors import CheckpointError
from fourfold.models.init import canonical_name, local_part, shard_extent


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper, else the module."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def as_module(model: nn.Module | list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the Llama names, also for a list of pipeline chunks."""
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        return _unwrap(model)
    chunks = [_unwrap(chunk) for chunk in model]
    if len(chunks) == 1:
        return chunks[0]
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for chunk in chunks:
        for name in ("tok_embeddings", "norm", "output"):
            part = getattr(chunk, name, None)
            if part is not None:
                setattr(view, name, part)
        for key, block in chunk.layers.items():
            view.layers[key] = block
    return view


def model_tensors(model) -> dict[str, torch.Tensor]:
    """Canonical name -> every tensor of the model's state dict (as held: DTensor shards stay sharded)."""
    module = as_module(model)
    return {canonical_name(k): v for k, v in module.state_dict(keep_vars=True).items()}


def _named_params(model, optimizer) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, parameter) of the optimizer's parameters, in param-group order (torch's integer ids)."""
    name_of = {id(p): canonical_name(n) for n, p in as_module(model).named_parameters()}
    return [(name_of[id(p)], p) for g in optimizer.param_groups for p in g["params"]]


def param_groups(model, optimizer) -> list[dict]:
    """The optimizer's param groups, JSON-able, with parameter names instead of parameters."""
    named = iter(_named_params(model, optimizer))
    groups = []
    for g in optimizer.param_groups:
        record = {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        record["params"] = [next(named)[0] for _ in g["params"]]
        groups.append(record)
    return groups


def is_zero(optimizer) -> bool:
    """Whether `optimizer` is a ZeroRedundancyOptimizer (each rank holds the state of its own parameters)."""
    return hasattr(optimizer, "consolidate_state_dict")


def optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """`state.<param>.<key>` -> every optimizer state tensor this rank holds (ZeRO-1: of the parameters it owns)."""
    state = optimizer.optim.state if is_zero(optimizer) else optimizer.state
    out = {}
    for name, p in _named_params(model, optimizer):
        for key, value in state.get(p, {}).items():
            out[f"state.{name}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


# ----- loading ----------------------------------------------------------------------------------

def check_model_tensors(model, reader: TensorReader) -> None:
    """Raise CheckpointError unless the files hold every model tensor with the shape the model expects."""
    for name, t in model_tensors(model).items():
        shape = reader.shape(name)
        if shape is None:
            files = sorted({p.name for p in reader.files.values()})
            raise CheckpointError(f"The checkpoint has no tensor '{name}' (files: {', '.join(files)}); it was saved "
                                  "from a different model shape: use the config it was trained with.")
        if shape != tuple(t.shape):
            raise CheckpointError(f"{reader.files[name]}: tensor '{name}' has shape {list(shape)} but the model "
                                  f"expects {list(t.shape)}; the checkpoint was saved from a different model config.")


@torch.no_grad()
def load_model_tensors(model, reader: TensorReader) -> None:
    """Fill every model tensor with its value from the files, this rank reading only its shard."""
    check_model_tensors(model, reader)
    for name, t in model_tensors(model).items():
        local_shape, offset = shard_extent(t)
        local_part(t).copy_(reader.get_block(name, offset, local_shape))


def _read_like(reader: TensorReader, flat: str, param: torch.Tensor) -> torch.Tensor:
    """A saved optimizer tensor as the optimizer keeps it: a tensor with the parameter's shape is read as
    the parameter's shard (a DTensor like it, or a plain tensor on its device); others (the 0-d `step`)
    as saved."""
    if reader.shape(flat) != tuple(param.shape) or param.dim() == 0:
        return reader.get(flat)
    local_shape, offset = shard_extent(param)
    local = reader.get_block(flat, offset, local_shape).to(local_part(param).device)
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride())
    return local


def load_optimizer_state(model, optimizer, reader: TensorReader, saved_groups: list[dict]) -> None:
    """Load the optimizer state from the files (ZeRO-1: only the parameters this rank owns)."""
    keys: dict[str, list[str]] = {}
    for flat in reader.names():
        if flat.startswith("state."):
            name, key = flat[len("state."):].rsplit(".", 1)
            keys.setdefault(name, []).append(key)
    owned = {id(p) for g in optimizer.optim.param_groups for p in g["params"]} if is_zero(optimizer) else None
    named = _named_params(model, optimizer)
    state = {}
    for index, (name, p) in enumerate(named):
        if owned is not None and id(p) not in owned:
            continue
        values = {key: _read_like(reader, f"state.{name}.{key}", p) for key in keys.get(name, [])}
        if values:
            state[index] = values
    saved_by_param = {n: g for g in saved_groups for n in g["params"]}
    groups, index = [], 0
    for g in optimizer.param_groups:
        ids = list(range(index, index + len(g["params"])))
        first = named[index][0] if ids else None
        saved = saved_by_param.get(first, {k: v for k, v in g.items() if k != "params"})
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        index += len(ids)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
