"""Model and optimizer state by canonical parameter name: what this rank holds, as DCP state dicts.

Saving: `model_tensors` and `optimizer_tensors` name what this rank holds (DTensor shards stay sharded;
ZeRO-1 ranks list only the state of the parameters they own); torch.distributed.checkpoint writes them.
Loading: `optimizer_destinations` makes empty tensors shaped (and sharded) like the parameters for the
saved optimizer entries, DCP fills them and the model's own tensors in place (each rank reading only its
block), and `install_optimizer_state` hands them to the optimizer.

Names are the unwrapped Llama names (`fourfold.models.init.canonical_name`), the same under every layout,
which is what lets a checkpoint reshard: pipeline chunks (a list of modules) are viewed as one module with
the original Llama names. Optimizer tensors are keyed `state.<param>.<key>` (exp_avg, exp_avg_sq, step);
their param groups (hyper-parameters, parameter names) are JSON.
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.errors import CheckpointError
from fourfold.models.init import canonical_name


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

def check_model_tensors(model, saved: dict, where: str, everyone: set[str]) -> None:
    """Raise CheckpointError unless `saved` (metadata.json's tensors) has every model tensor with its shape, and
    no model tensor outside `everyone` (the names all ranks' parts of the model hold together)."""
    extra = sorted(n for n in saved if not n.startswith("state.") and n not in everyone)
    if extra:
        raise CheckpointError(f"{where}: the checkpoint holds tensors the model does not have ({', '.join(extra[:3])}"
                              f"{', ...' if len(extra) > 3 else ''}); it was saved from a different model shape: use "
                              "the config it was trained with.")
    for name, t in model_tensors(model).items():
        entry = saved.get(name)
        if entry is None:
            raise CheckpointError(f"{where}: the checkpoint has no tensor '{name}'; it was saved from a different "
                                  "model shape: use the config it was trained with.")
        if tuple(entry["shape"]) != tuple(t.shape):
            raise CheckpointError(f"{where}: tensor '{name}' has shape {entry['shape']} but the model expects "
                                  f"{list(t.shape)}; the checkpoint was saved from a different model config.")


def owned_params(model, optimizer) -> list[tuple[int, str, torch.Tensor]]:
    """(torch's integer id, name, parameter) of the parameters whose state this rank keeps (ZeRO-1: its own)."""
    owned = {id(p) for g in optimizer.optim.param_groups for p in g["params"]} if is_zero(optimizer) else None
    return [(i, name, p) for i, (name, p) in enumerate(_named_params(model, optimizer))
            if owned is None or id(p) in owned]


def optimizer_destinations(model, optimizer, saved: dict, where: str) -> dict[str, torch.Tensor]:
    """`state.<param>.<key>` -> an empty tensor to load into, for every saved entry of the parameters this rank
    keeps: shaped and sharded like the parameter, or as saved (the 0-d `step`)."""
    keys: dict[str, list[str]] = {}
    for flat in saved:
        if flat.startswith("state."):
            name, key = flat[len("state."):].rsplit(".", 1)
            keys.setdefault(name, []).append(key)
    out = {}
    for _, name, p in owned_params(model, optimizer):
        if name not in keys:
            raise CheckpointError(f"{where}: the checkpoint has no optimizer state for '{name}'; it cannot resume "
                                  "training exactly (it was saved without an optimizer, or from another model).")
        for key in keys[name]:
            entry = saved[f"state.{name}.{key}"]
            dtype = getattr(torch, entry["dtype"])
            if tuple(entry["shape"]) == tuple(p.shape) and p.dim() > 0:
                out[f"state.{name}.{key}"] = torch.empty_like(p, dtype=dtype, requires_grad=False)
            else:
                out[f"state.{name}.{key}"] = torch.empty(entry["shape"], dtype=dtype)
    return out


def install_optimizer_state(model, optimizer, loaded: dict[str, torch.Tensor], saved_groups: list[dict]) -> None:
    """Give the optimizer the loaded state (ZeRO-1: of the parameters this rank owns) and the saved groups."""
    named = _named_params(model, optimizer)
    state = {}
    for index, name, _ in owned_params(model, optimizer):
        prefix = f"state.{name}."
        values = {flat[len(prefix):]: t for flat, t in loaded.items() if flat.startswith(prefix)}
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
