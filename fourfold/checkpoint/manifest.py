"""The COMPLETE marker: written last, it lists every file of a checkpoint with its size and sha256.

    write_manifest(directory, step, known={"model-00000.safetensors": {"bytes": ..., "sha256": ...}})
    is_complete(directory)          # the marker exists: every file was written and fsynced before it
    verify_files(directory)         # CheckpointError naming the first missing, truncated or altered file

Shard files are hashed while they are written (`SequentialSafetensorsWriter`), so the marker costs no
second read of the tensors; the small JSON files are hashed here. Verification reads every file once;
under several ranks each rank checks a share of the files and all learn of any failure (`verify_shared`),
so a damaged checkpoint is refused before a single tensor is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from fourfold.errors import CheckpointError

MARKER = "COMPLETE"
FORMAT = "fourfold-checkpoint-2"
READ_BYTES = 16 << 20


def file_digest(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of the file at `path`, read in pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
            size += len(piece)
    return {"bytes": size, "sha256": digest.hexdigest()}


def write_manifest(directory: Path, step: int, known: dict[str, dict]) -> None:
    """Write the marker: `known` digests for shard files, computed here for every other file; fsynced."""
    directory = Path(directory)
    files = {}
    for path in sorted(directory.iterdir()):
        if path.name == MARKER or not path.is_file():
            continue
        files[path.name] = known[path.name] if path.name in known else file_digest(path)
    with open(directory / MARKER, "w") as f:
        json.dump({"format": FORMAT, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def is_complete(directory: Path) -> bool:
    """Whether `directory` holds the marker (so every file of the checkpoint was written before it)."""
    return (Path(directory) / MARKER).is_file()


def read_manifest(directory: Path) -> dict:
    """The marker's record; CheckpointError if the marker is absent or unreadable."""
    path = Path(directory) / MARKER
    try:
        record = json.loads(path.read_text())
        record["files"].items()
        return record
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path} is missing or invalid ({e}): {directory} is not a complete checkpoint "
                              "(a save that did not finish); resume from an earlier one.") from None


def check_file(directory: Path, name: str, expected: dict, hash_it: bool) -> str | None:
    """What is wrong with file `name` of the checkpoint (missing, wrong size, wrong checksum), or None."""
    path = Path(directory) / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path} is {size} bytes but was written with {expected['bytes']} (truncated or overwritten)"
    if hash_it and file_digest(path)["sha256"] != expected["sha256"]:
        return f"{path} does not match its sha256 checksum (the file was altered or corrupted on disk)"
    return None


def verify_files(directory: Path, share: tuple[int, int] = (0, 1), hash_it: bool = True,
                 names=None) -> str | None:
    """Check sizes of the files (`names`, default all) and checksums of this rank's share (index, count) of
    them: the first problem, or None."""
    record = read_manifest(directory)
    index, count = share
    chosen = sorted((n, e) for n, e in record["files"].items() if names is None or n in names)
    missing = sorted(set(names or ()) - set(record["files"]))
    if missing:
        return f"{Path(directory) / missing[0]} is not listed in {MARKER}"
    for i, (name, expected) in enumerate(chosen):
        problem = check_file(directory, name, expected, hash_it and i % count == index)
        if problem:
            return problem
    return None


def small_files(directory: Path) -> set[str]:
    """The files of the checkpoint other than tensor shards (JSON, tokenizer): checked before they are parsed."""
    return {n for n in read_manifest(directory)["files"] if not n.endswith(".safetensors")}


def verify_shared(directory: Path, hash_it: bool = True, names=None) -> None:
    """Every rank checks its share of the files (`names`, default all); CheckpointError on every rank if any
    rank found a problem."""
    if dist.is_initialized():
        try:
            problem = verify_files(directory, (dist.get_rank(), dist.get_world_size()), hash_it, names)
        except CheckpointError as e:
            problem = str(e)
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problems = [p for p in found if p]
        problem = problems[0] if problems else None
    else:
        problem = verify_files(directory, hash_it=hash_it, names=names)
    if problem:
        raise CheckpointError(f"Checkpoint {directory} is damaged: {problem}. Resume from an earlier checkpoint "
                              "or retrain.")
