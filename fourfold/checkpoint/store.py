"""Checkpoints: full tensors by parameter name in safetensors, the rest in JSON, written atomically.

    save_checkpoint(run_dir, step, model, optimizer, meta, keep, writer=is_writer, shard_name="model")
    meta = load_checkpoint(path, model, optimizer)

A checkpoint is `run_dir/checkpoints/step_N/` holding `model-<shard>.safetensors`,
`optim-<shard>.safetensors`, `optim-<shard>.json` (param groups) and `meta.json`. Tensors are full
(unsharded) and keyed by the model's parameter names, which every layout keeps, so a checkpoint written
under one layout loads under any other. Pipeline stages each write their own shard (`stage0`, ...).

Memory: saving sends each rank's block of each tensor to the writer, which writes it at its place in the
file and drops it (`fourfold.checkpoint.gather`, `fourfold.checkpoint.safetensors_io`): no rank assembles a
full tensor, the writer holds one received block at a time beyond its own shards. Loading reads one
tensor at a time, only the block this rank holds (`fourfold.checkpoint.state`).

Atomicity: everything is written into `checkpoints/.tmp-step_N/`, files and directory fsynced, then the
directory is renamed to `step_N`; a crash mid-write leaves the previous checkpoint the newest complete
one. Loading reads only safetensors and JSON: no pickle, no code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from fourfold.checkpoint.gather import GatherPlan, gather_plan, send_blocks, write_gathered
from fourfold.checkpoint.safetensors_io import TensorReader
from fourfold.checkpoint.state import load_model_tensors, load_optimizer_state, model_tensors, optimizer_tensors, \
    param_groups
from fourfold.errors import CheckpointError


def _checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(plan: GatherPlan, path: Path) -> None:
    """Write the tensors of `plan` to the safetensors file `path`, block by block as they arrive; fsynced."""
    write_gathered(plan, path)


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


def checkpoint_at(path: str | Path) -> Path | None:
    """`path` itself if it is a complete checkpoint, else the newest complete one of the run directory `path`."""
    path = Path(path)
    return path if (path / "meta.json").is_file() else latest_checkpoint(path)


def resolve_resume(run_dir: Path, resume: str | bool) -> Path | None:
    """True/'latest' -> the newest checkpoint of run_dir (or None); a path -> that checkpoint."""
    if resume is True or resume == "latest":
        return latest_checkpoint(run_dir)
    inner = checkpoint_at(resume)
    if inner is None:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint there (a checkpoint directory holds "
                              "meta.json); pass a checkpoints/step_N directory or a run directory.")
    return inner


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(run_dir: Path, step: int, model: nn.Module | list[nn.Module], optimizer, meta: dict,
                    keep: int, *, writer: bool, shard_name: str = "model",
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write checkpoint `step`; collective (every rank calls it), ranks with writer=True write files.

    `extra_files` (name -> content; tokenizer.json, tokenizer_config.json, ...) are written by rank 0 into
    the checkpoint directory before it becomes visible.
    """
    root = _checkpoints_dir(run_dir)
    tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    shards: list[str] = [shard_name]
    model_plan = gather_plan(model_tensors(model), shard_name, writer)
    if writer:
        _save_tensors(model_plan, tmp / f"model-{shard_name}.safetensors")
    else:
        send_blocks(model_plan)
    if optimizer is not None:
        optim_plan = gather_plan(optimizer_tensors(model, optimizer), shard_name, writer)
        if writer:
            _save_tensors(optim_plan, tmp / f"optim-{shard_name}.safetensors")
            (tmp / f"optim-{shard_name}.json").write_text(json.dumps(param_groups(model, optimizer)))
        else:
            send_blocks(optim_plan)
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, shard_name if writer else None)
        shards = sorted({s for s in gathered if s is not None})
    _barrier()
    if is_rank0:
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)
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


def _shard_files(path: Path, meta: dict, kind: str, missing: str) -> list[Path]:
    """The `kind` (model/optim) safetensors file of every shard; CheckpointError with `missing` if one is absent."""
    files = [path / f"{kind}-{shard}.safetensors" for shard in meta["shards"]]
    for f in files:
        if not f.is_file():
            raise CheckpointError(missing.format(path=path, file=f.name, shard=f.stem.split("-", 1)[1]))
    return files


def load_checkpoint(path: Path, model: nn.Module | list[nn.Module], optimizer=None) -> dict:
    """Load weights (and optimizer state) into `model` from every shard file, one tensor at a time; return meta."""
    path = Path(path)
    meta = read_meta(path)
    model_files = _shard_files(path, meta, "model", "Checkpoint {path} lists shard '{shard}' but {file} is missing.")
    load_model_tensors(model, TensorReader(model_files))
    if optimizer is not None:
        optim_files = _shard_files(path, meta, "optim", "Checkpoint {path} has no optimizer state ({file}); it "
                                   "cannot resume training exactly.")
        reader = TensorReader(optim_files)
        groups = [g for shard in meta["shards"] for g in _read_groups(path / f"optim-{shard}.json")]
        load_optimizer_state(model, optimizer, reader, groups)
    return meta
