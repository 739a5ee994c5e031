"""Which checkpoints a run directory holds: complete ones (COMPLETE marker), unfinished ones, and keep-last-K.

    list_checkpoints(run_dir); latest_checkpoint(run_dir); checkpoint_at(path); resolve_resume(run_dir, resume)
    retain(run_dir, keep, protect=[...])
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fourfold.checkpoint.manifest import is_complete
from fourfold.errors import CheckpointError


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(p: Path) -> int:
    try:
        return int(p.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (the COMPLETE marker present), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith("step_") and _step_of(p) >= 0 and is_complete(p)]
    return sorted(done, key=_step_of)


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of `run_dir` without the marker (saves that never finished), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(("step_", ".tmp-step_"))
             and not is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_at(path: str | Path) -> Path | None:
    """`path` itself if it is a complete checkpoint, else the newest complete one of the run directory `path`."""
    path = Path(path)
    return path if is_complete(path) else latest_checkpoint(path)


def find_checkpoint(path: str | Path, setting: str | None = None) -> Path:
    """`checkpoint_at(path)`, or a CheckpointError saying what to pass when there is none (naming the config
    `setting` that gave the path, if any)."""
    found = checkpoint_at(path)
    if found is None:
        where = f"{setting} = '{path}'" if setting else f"No checkpoint found at '{path}'"
        raise CheckpointError(f"{where}: no complete fourfold checkpoint there (a checkpoint directory holds the COMPLETE "
                              "marker); pass a checkpoints/step_N directory, a run directory that has one (train "
                              "with checkpoint.save_final = true) or a consolidated model directory.")
    return found


def resolve_resume(run_dir: Path, resume: str | bool) -> Path | None:
    """True/'latest' -> the newest checkpoint of run_dir (or None); a path -> that checkpoint."""
    if resume is True or resume == "latest":
        return latest_checkpoint(run_dir)
    inner = checkpoint_at(resume)
    if inner is None:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint there (a checkpoint directory holds the "
                              "COMPLETE marker); pass a checkpoints/step_N directory or a run directory.")
    return inner


def retain(run_dir: Path, keep: int, protect=()) -> None:
    """Delete complete checkpoints older than the newest `keep` (0 keeps all), except those in `protect`."""
    if keep <= 0:
        return
    protected = {Path(p).resolve() for p in protect}
    for old in list_checkpoints(run_dir)[:-keep]:
        if old.resolve() not in protected:
            shutil.rmtree(old, ignore_errors=True)
