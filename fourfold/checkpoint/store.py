"""Checkpoints: every rank writes its own shards in parallel (torch.distributed.checkpoint), made visible atomically.

    save_checkpoint(run_dir, step, model, optimizer, meta, keep)
    meta = load_checkpoint(path, model, optimizer)      # any layout loads a checkpoint of any other

A checkpoint is `run_dir/checkpoints/step_N/` holding `model-<rank>.safetensors` and
`optim-<rank>.safetensors` (the chunks of weights and of optimizer state that rank wrote),
`metadata.json` (every tensor's shape, dtype and chunks: where each chunk lives), `optim.json` (the
optimizer's param groups), `meta.json` (step, config, data position, ...), any extra files
(tokenizer) and, written last, `COMPLETE` (size and sha256 of every file). Tensors are keyed by the
model's parameter names, which every layout keeps, and DCP plans the save (DTensor shards as they are,
whole tensors held by several ranks written once) and the load (each rank reads only the parts of the
saved chunks that overlap its own shard); `fourfold.checkpoint.dcp_storage` keeps the bytes in
safetensors and the metadata in JSON, so loading never unpickles.

Atomicity: everything is written into `checkpoints/.tmp-step_N/`, each file fsynced, the marker last,
then the directory is renamed to `step_N`; only directories with the marker count (`list_checkpoints`).
Loading first checks the files it needs against the marker (sizes, and checksums shared among ranks; the
weight files alone when no optimizer is loaded), so a truncated, altered or missing file is a
CheckpointError naming it before any tensor is loaded.
Keep-last-K deletes older complete checkpoints only, never one named in `protect` (the trainer passes
the checkpoint it resumed from), and never the one just written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from fourfold.checkpoint.dcp_storage import SafetensorsStorageReader, SafetensorsStorageWriter, files_for, \
    read_storage_metadata, write_json
from fourfold.checkpoint.listing import checkpoint_at, checkpoints_dir, fsync_dir, incomplete_checkpoints, \
    latest_checkpoint, list_checkpoints, resolve_resume, retain
from fourfold.checkpoint.manifest import small_files, verify_shared, write_manifest
from fourfold.checkpoint.state import check_model_tensors, install_optimizer_state, model_tensors, \
    optimizer_destinations, optimizer_tensors, param_groups
from fourfold.errors import CheckpointError

OPTIM_GROUPS = "optim.json"
# Re-exported: callers find every checkpoint entry point here.
__all__ = ["save_checkpoint", "load_checkpoint", "read_meta", "write_checkpoint", "checkpoint_state",
           "gather_param_groups", "checkpoint_at", "latest_checkpoint", "list_checkpoints", "incomplete_checkpoints",
           "resolve_resume", "retain"]


@contextlib.contextmanager
def _dcp_call():
    """Around a DCP save or load: its single-process warning silenced (one process is meant here), and the
    first rank's failure raised as itself (a CheckpointError naming the file, an OSError) rather than
    wrapped in DCP's CheckpointException, a BaseException with every rank's traceback."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            failures = [f[0] if isinstance(f, tuple) else f for _, f in sorted(e.failures.items())]
            first = next((f for f in failures if isinstance(f, Exception)), None)
            if first is None:
                raise
            raise first from None


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def gather_param_groups(model, optimizer) -> list[dict]:
    """Every rank's optimizer param groups (collective), each group once: pipeline stages hold different ones."""
    mine = param_groups(model, optimizer) if optimizer is not None else []
    if not dist.is_initialized():
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    unique: dict[tuple, dict] = {}
    for groups in everyone:
        for g in groups:
            unique.setdefault(tuple(g["params"]), g)
    return list(unique.values())


def checkpoint_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The flat state dict DCP saves: model tensors by name, then optimizer tensors (`state.<param>.<key>`)."""
    state = dict(model_tensors(model))
    if optimizer is not None:
        state.update(optimizer_tensors(model, optimizer))
    return state


def write_checkpoint(run_dir: Path, step: int, state: dict[str, torch.Tensor], groups: list[dict] | None,
                     meta: dict, keep: int, extra_files: dict[str, bytes] | None = None, protect=(),
                     group=None) -> Path:
    """Write `state` (this rank's part) as checkpoint `step` through DCP and make it visible; collective over
    `group` (default: every rank). The asynchronous saver calls this from its thread with its own group."""
    root = checkpoints_dir(run_dir)
    tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
    is_rank0 = not dist.is_initialized() or dist.get_rank(group) == 0
    if is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    writer = SafetensorsStorageWriter(tmp)
    with _dcp_call():
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False),
                 process_group=group, no_dist=not dist.is_initialized())
    if is_rank0:
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)
        if groups is not None:
            write_json(tmp / OPTIM_GROUPS, groups)
        write_json(tmp / "meta.json", {**meta, "step": step})
        write_manifest(tmp, step, getattr(writer, "files", {}))
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        retain(run_dir, keep, protect={final, *map(Path, protect)})
    _barrier(group)
    return final


def save_checkpoint(run_dir: Path, step: int, model: nn.Module | list[nn.Module], optimizer, meta: dict,
                    keep: int, *, writer: bool = True, shard_name: str = "model",
                    extra_files: dict[str, bytes] | None = None, protect=()) -> Path:
    """Write checkpoint `step` now; collective (every rank calls it, each writing its own shards).

    `writer` and `shard_name` are accepted for compatibility and unused: DCP decides who writes what.
    `extra_files` (name -> content; tokenizer.json, tokenizer_config.json, ...) are written by rank 0 into
    the checkpoint directory before it becomes visible. `protect`: checkpoints keep-K must not delete.
    """
    groups = gather_param_groups(model, optimizer) if optimizer is not None else None
    return write_checkpoint(run_dir, step, checkpoint_state(model, optimizer), groups, meta, keep, extra_files,
                            protect)


def read_meta(path: Path) -> dict:
    """A checkpoint directory's meta.json as a dict; CheckpointError if it is missing, invalid or lacks `step`."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
        int(meta["step"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = f"no '{e.args[0]}' entry" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{file} is missing or invalid ({reason}); this is not a complete fourfold "
                              "checkpoint.") from None


def _read_groups(path: Path) -> list:
    try:
        return json.loads((path / OPTIM_GROUPS).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint file {path / OPTIM_GROUPS} is missing or invalid ({e}); the checkpoint "
                              "has no optimizer state to resume from.") from None


def _all_ranks_names(model) -> set[str]:
    """The model tensor names of every rank together (pipeline stages each hold some); collective."""
    mine = sorted(model_tensors(model))
    if not dist.is_initialized():
        return set(mine)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name for names in everyone for name in names}


def load_checkpoint(path: Path, model: nn.Module | list[nn.Module], optimizer=None, *, verify: bool = True) -> dict:
    """Load weights (and optimizer state) into `model`, each rank reading only its shards; return meta.

    Collective under torch.distributed. Every file is checked against the COMPLETE marker first
    (`verify=False` checks sizes only), so a damaged checkpoint raises CheckpointError before anything loads.
    """
    path = Path(path)
    meta = read_meta(path)
    verify_shared(path, hash_it=verify, names=small_files(path))
    record = read_storage_metadata(path)
    verify_shared(path, hash_it=verify, names=files_for(record, optimizer is not None))
    where = str(path / "metadata.json")
    check_model_tensors(model, record["tensors"], where, _all_ranks_names(model))
    state = dict(model_tensors(model))
    destinations = {}
    if optimizer is not None:
        groups = _read_groups(path)
        destinations = optimizer_destinations(model, optimizer, record["tensors"], where)
        state.update(destinations)
    with torch.no_grad(), _dcp_call():
        dcp.load(state, storage_reader=SafetensorsStorageReader(path),
                 planner=DefaultLoadPlanner(flatten_state_dict=False), no_dist=not dist.is_initialized())
    if optimizer is not None:
        install_optimizer_state(model, optimizer, destinations, groups)
    return meta
