"""Checkpoints: full tensors by parameter name in safetensors, the rest in JSON, written atomically.

    save_checkpoint(run_dir, step, model, optimizer, meta, keep, writer=is_writer, shard_name="model")
    meta = load_checkpoint(path, model, optimizer)

A checkpoint is `run_dir/checkpoints/step_N/` holding `model-<shard>.safetensors`,
`optim-<shard>.safetensors` and `meta.json`. Tensors are full (unsharded) and keyed by the model's
parameter names, which every layout keeps, so a checkpoint written under one layout loads under any
other: PyTorch's `torch.distributed.checkpoint.state_dict` gathers shards (FSDP2, DTensor) into full
tensors on save and scatters them on load. Pipeline stages each write their own shard (`stage0`, ...).

Atomicity: everything is written into `checkpoints/.tmp-step_N/`, files and directory fsynced, then the
directory is renamed to `step_N`; a crash mid-write leaves the previous checkpoint the newest complete
one. Loading reads only safetensors and JSON: no pickle, no code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from fourfold.errors import CheckpointError
from fourfold.checkpoint.state import (flatten_optimizer, full_model_state, full_optimizer_state,
                                             set_full_state, unflatten_optimizer)


def _checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _step_of(p: Path) -> int:
    try:
        return int(p.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (meta.json present), oldest first."""
    root = _checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith("step_") and (p / "meta.json").is_file()]
    return sorted(done, key=_step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(run_dir: Path, resume: str | bool) -> Path | None:
    """True/'latest' -> the newest checkpoint of run_dir (or None); a path -> that checkpoint."""
    if resume is True or resume == "latest":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if (path / "meta.json").is_file():
        return path
    inner = latest_checkpoint(path)
    if inner is None:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint there (a checkpoint directory holds "
                              "meta.json); pass a checkpoints/step_N directory or a run directory.")
    return inner


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(run_dir: Path, step: int, model: nn.Module | list[nn.Module], optimizer, meta: dict,
                    keep: int, *, writer: bool, shard_name: str = "model") -> Path:
    """Write checkpoint `step`; collective (every rank calls it), ranks with writer=True write files."""
    root = _checkpoints_dir(run_dir)
    tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_state = full_model_state(model)
    optim_state = full_optimizer_state(model, optimizer) if optimizer is not None else None
    shards: list[str] = [shard_name]
    if writer:
        _save_tensors(model_state, tmp / f"model-{shard_name}.safetensors")
        if optim_state is not None:
            tensors, groups = flatten_optimizer(optim_state)
            _save_tensors(tensors, tmp / f"optim-{shard_name}.safetensors")
            (tmp / f"optim-{shard_name}.json").write_text(json.dumps(groups))
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, shard_name if writer else None)
        shards = sorted({s for s in gathered if s is not None})
    _barrier()
    if is_rank0:
        record = {**meta, "step": step, "shards": shards}
        with open(tmp / "meta.json", "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint file {path} is truncated or corrupt ({e}); resume from an earlier "
                              "checkpoint or retrain.") from None


def _read_groups(path: Path) -> list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint file {path} is missing, truncated or corrupt ({e}); resume from an "
                              "earlier checkpoint or retrain.") from None


def read_meta(path: Path) -> dict:
    """A checkpoint directory's meta.json as a dict; CheckpointError if it is missing, invalid or lacks shards."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
        meta["shards"]
        return meta
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{Path(path) / 'meta.json'} is missing or invalid ({e}); this is not a complete "
                              "fourfold checkpoint.") from None


def load_checkpoint(path: Path, model: nn.Module | list[nn.Module], optimizer=None) -> dict:
    """Load weights (and optimizer state) into `model` from every shard file; return the meta dict."""
    path = Path(path)
    meta = read_meta(path)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for shard in meta["shards"]:
        f = path / f"model-{shard}.safetensors"
        if not f.is_file():
            raise CheckpointError(f"Checkpoint {path} lists shard '{shard}' but {f.name} is missing.")
        for k, v in _read_tensors(f).items():
            tensors[k], origin[k] = v, f
    optim_state = None
    if optimizer is not None:
        flat, groups = {}, []
        for shard in meta["shards"]:
            f = path / f"optim-{shard}.safetensors"
            if not f.is_file():
                raise CheckpointError(f"Checkpoint {path} has no optimizer state ({f.name}); it cannot resume "
                                      "training exactly.")
            flat.update(_read_tensors(f))
            groups.extend(_read_groups(path / f"optim-{shard}.json"))
        optim_state = unflatten_optimizer(flat, groups)
    set_full_state(model, optimizer, tensors, optim_state, origin)
    return meta
