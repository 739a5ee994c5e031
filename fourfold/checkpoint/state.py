"""Full (unsharded) model and optimizer state by parameter name, from and into any layout.

Built on `torch.distributed.checkpoint.state_dict`, which gathers FSDP2/DTensor shards into full tensors
and scatters full tensors back into whatever sharding the receiving model has; names are canonical
(wrapper prefixes such as torch.compile's `_orig_mod.` removed), so they match across layouts.
Pipeline chunks (a list of modules) are viewed as one module with the original Llama names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from fourfold.errors import CheckpointError

FULL = StateDictOptions(full_state_dict=True, cpu_offload=False)
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical(name: str) -> str:
    """A parameter name without wrapper segments: layers.0._orig_mod.attention.wq.weight -> layers.0.attention.wq.weight."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def as_module(model: nn.Module | list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the Llama names, also for a list of pipeline chunks."""
    if isinstance(model, nn.Module):
        return model
    if len(model) == 1:
        return model[0]
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for chunk in model:
        for name in ("tok_embeddings", "norm", "output"):
            part = getattr(chunk, name, None)
            if part is not None:
                setattr(view, name, part)
        for key, block in chunk.layers.items():
            view.layers[key] = block
    return view


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_model_state(model) -> dict[str, torch.Tensor]:
    """Every model tensor, full and on CPU, keyed by canonical name (collective under FSDP/TP)."""
    state = get_model_state_dict(as_module(model), options=FULL)
    return {canonical(k): _local(v).detach().cpu() for k, v in state.items()}


def _param_names(model, optimizer) -> list[str]:
    """Canonical names of the optimizer's parameters, in param-group order (torch's integer ids)."""
    name_of = {id(p): canonical(n) for n, p in as_module(model).named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _zero_state(model, optimizer) -> dict:
    """ZeroRedundancyOptimizer (ZeRO-1): gather every rank's shard of the state, then name it."""
    import torch.distributed as dist

    optimizer.consolidate_state_dict(to=0)
    sd = optimizer.state_dict() if dist.get_rank() == 0 else None
    box = [sd]
    dist.broadcast_object_list(box, src=0)
    sd, names = box[0], _param_names(model, optimizer)
    state = {names[i]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state dict with full tensors keyed by canonical parameter names."""
    if hasattr(optimizer, "consolidate_state_dict"):
        return _zero_state(model, optimizer)
    sd = get_optimizer_state_dict(as_module(model), optimizer, options=FULL)
    state = {canonical(k): {n: _local(v).detach().cpu() if torch.is_tensor(v) else v for n, v in s.items()}
             for k, s in sd["state"].items()}
    groups = [{**g, "params": [canonical(p) for p in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(tensors keyed 'state.<param>.<key>', JSON-able param groups) from an optimizer state dict."""
    tensors = {}
    for name, s in sd["state"].items():
        for key, value in s.items():
            tensors[f"state.{name}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    """The inverse of `flatten_optimizer`: an optimizer state dict keyed by parameter name."""
    state: dict[str, dict] = {}
    for flat, value in tensors.items():
        name, key = flat[len("state."):].rsplit(".", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": groups}


def expected_shapes(model) -> dict[str, tuple]:
    """Canonical name -> full (global) shape of every tensor the model's state dict holds."""
    return {canonical(k): tuple(v.shape) for k, v in as_module(model).state_dict().items()}


def set_full_state(model, optimizer, tensors: dict[str, torch.Tensor], optim_state: dict | None,
                   origin: dict[str, Path]) -> None:
    """Check names and shapes, then load full tensors into the (possibly sharded) model and optimizer."""
    module = as_module(model)
    expected = expected_shapes(module)
    for name, shape in expected.items():
        if name not in tensors:
            files = sorted({p.name for p in origin.values()})
            raise CheckpointError(f"The checkpoint has no tensor '{name}' (files: {', '.join(files)}); it was saved "
                                  "from a different model shape: use the config it was trained with.")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{origin[name]}: tensor '{name}' has shape {list(tensors[name].shape)} but the "
                                  f"model expects {list(shape)}; the checkpoint was saved from a different model "
                                  "config.")
    by_raw = {k: tensors[canonical(k)] for k in module.state_dict()}
    set_model_state_dict(module, by_raw, options=FULL)
    if optimizer is not None and optim_state is not None and hasattr(optimizer, "consolidate_state_dict"):
        names = _param_names(module, optimizer)
        index = {n: i for i, n in enumerate(names)}
        state = {index[n]: s for n, s in optim_state["state"].items()}
        groups = [{**g, "params": [index[p] for p in g["params"]]} for g in optim_state["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    elif optimizer is not None and optim_state is not None:
        raw_names = {canonical(k): k for k in module.state_dict()}
        state = {raw_names.get(n, n): s for n, s in optim_state["state"].items() if n in raw_names}
        groups = [{**g, "params": [raw_names[p] for p in g["params"] if p in raw_names]}
                  for g in optim_state["param_groups"]]
        set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": groups}, options=FULL)
