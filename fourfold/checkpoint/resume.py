"""Resuming a run: the newest checkpoint that loads cleanly, falling back past damaged ones, and its checks.

    path, meta = resume_from(run_dir, resume, modules, optimizer, log=print)
    check_data_position(meta, path, data_signature(cfg, n_sequences))

`resume=True` (or "latest") tries the complete checkpoints newest first: one that fails its checks (a
truncated, altered or missing file) is reported by name and the previous one is tried; incomplete
directories (no COMPLETE marker) are skipped with a warning naming them. An explicit path is loaded or
refused, never substituted. Checks happen before any tensor is loaded, so nothing is ever half loaded.

The saved data position (the sampler's epoch and offset) only means the same samples under the same
global batch, sequence length and data; `check_data_position` refuses a resume where they changed, and
points at `checkpoint.init_from` (weights only, fresh data position) as the way to continue anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fourfold.checkpoint.store import incomplete_checkpoints, list_checkpoints, load_checkpoint, read_meta, \
    resolve_resume
from fourfold.errors import CheckpointError

DATA_KEYS = ("global_batch", "seq_len", "data_path", "sequences")


def _candidates(run_dir: Path, resume: str | bool) -> list[Path]:
    if resume is True or resume == "latest":
        return list_checkpoints(run_dir)[::-1]
    return [resolve_resume(run_dir, resume)]


def resume_from(run_dir: Path, resume: str | bool, modules, optimizer, log: Callable[[str], None],
                verify: bool = True) -> tuple[Path | None, dict | None]:
    """Load the checkpoint to resume from (collective); (its path, its meta), or (None, None) if there is none."""
    automatic = resume is True or resume == "latest"
    if automatic:
        skipped = incomplete_checkpoints(run_dir)
        if skipped:
            log(f"[yellow]Skipping incomplete checkpoints (no COMPLETE marker; a save that did not finish): "
                f"{', '.join(str(p) for p in skipped)}[/]")
    failed: list[tuple[Path, CheckpointError]] = []
    for path in _candidates(run_dir, resume):
        try:
            check_resumable(read_meta(path), path)
            meta = load_checkpoint(path, modules, optimizer, verify=verify)
        except CheckpointError as e:
            if not automatic:
                raise
            failed.append((path, e))
            log(f"[yellow]{e}[/]")
            continue
        if failed:
            log(f"[yellow]Checkpoint {failed[0][0]} could not be loaded; resumed from the previous complete "
                f"checkpoint {path} instead.[/]")
        return path, meta
    if failed:
        raise CheckpointError(f"No checkpoint of {run_dir} could be loaded; the newest, {failed[0][0]}, failed "
                              f"with: {failed[0][1]}")
    return None, None


def check_resumable(meta: dict, path: Path) -> None:
    """CheckpointError unless meta.json has what resuming needs: the step and the data position."""
    for key in ("step", "data"):
        if key not in meta:
            raise CheckpointError(f"{Path(path) / 'meta.json'} has no '{key}' entry: it cannot resume a training run "
                                  "(it may be a consolidated model); start from its weights with "
                                  "checkpoint.init_from instead.")


def data_signature(global_batch: int, seq_len: int, data_path: str, sequences: int | None) -> dict:
    """What the saved data position depends on, as stored in meta.json under `data_signature`."""
    return {"global_batch": global_batch, "seq_len": seq_len, "data_path": str(data_path), "sequences": sequences}


def check_data_position(meta: dict, path: Path, now: dict) -> None:
    """CheckpointError if the batch size, sequence length or data changed since the checkpoint was saved."""
    saved = meta.get("data_signature")
    if saved is None:
        return
    changed = [f"{key} {saved.get(key)!r} -> {now.get(key)!r}" for key in DATA_KEYS if saved.get(key) != now.get(key)]
    if changed:
        raise CheckpointError(f"Checkpoint {path} was saved with different data settings ({'; '.join(changed)}); "
                              "its saved data position would not point at the same samples. Resume with the "
                              "settings it was saved with, or start a new run from its weights with "
                              f"--checkpoint.init_from {path}.")
