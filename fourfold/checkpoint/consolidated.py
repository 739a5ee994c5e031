"""Whole tensors in one process: read any fourfold checkpoint's model, write a single-file consolidated model.

    config, tensors = read_model_tensors("runs/a")                   # {name: full tensor} on the CPU
    write_consolidated("out/model", config, tensors, extra_files={"tokenizer.json": ...})
    consolidate("runs/a/checkpoints/step_100", "out/model")          # the two above, plus the tokenizer files
    shard_consolidated("out/model", "runs/b")                        # the reverse: a model directory -> step_0 of a run

A consolidated directory holds `model.safetensors` (every model tensor whole, under its parameter name:
safetensors' own `load_file` reads it), `metadata.json`, `meta.json` (step 0, the config) and the
COMPLETE marker, i.e. it is a fourfold checkpoint with one chunk per tensor: `load_checkpoint`,
`fourfold generate` and `checkpoint.init_from` load it under any layout as they load a sharded one
(model only: it carries no optimizer state or data position). `shard_consolidated` copies one into a run
directory's checkpoints so that tools that look for `checkpoints/step_N` find it.

These are tools for one process holding the whole model in host memory (conversion, export); training
never calls them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fourfold.checkpoint.dcp_storage import METADATA_FILE, read_storage_metadata, write_json
from fourfold.checkpoint.manifest import write_manifest
from fourfold.checkpoint.safetensors_io import SequentialSafetensorsWriter
from fourfold.checkpoint.listing import find_checkpoint
from fourfold.checkpoint.store import read_meta
from fourfold.errors import CheckpointError

MODEL_FILE = "model.safetensors"
# What a checkpoint holds besides tensors and its own bookkeeping: copied along by consolidate.
BOOKKEEPING = {"COMPLETE", METADATA_FILE, "meta.json", "optim.json"}


def read_model_tensors(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the saved config dict, {parameter name: full tensor on the CPU}) of a checkpoint, run or consolidated
    directory; optimizer entries are left out. Chunks are assembled in place, one file open at a time."""
    found = find_checkpoint(path)
    meta = read_meta(found)
    record = read_storage_metadata(found)
    tensors = {name: torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]))
               for name, t in record["tensors"].items() if not name.startswith("state.")}
    by_file: dict[str, list[dict]] = {}
    for chunk in record["storage"]:
        if chunk["fqn"] in tensors:
            by_file.setdefault(chunk["file"], []).append(chunk)
    chunks = {name: t["chunks"] for name, t in record["tensors"].items()}
    for name, entries in by_file.items():
        try:
            with safe_open(str(found / name), framework="pt") as handle:
                for chunk in entries:
                    block = handle.get_tensor(chunk["key"])
                    index = tuple(slice(o, o + n) for o, n in zip(chunk["offset"], block.shape))
                    tensors[chunk["fqn"]][index] = block
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"Checkpoint file {found / name} cannot be read ({e}).") from None
    covered = {chunk["fqn"] for entries in by_file.values() for chunk in entries}
    missing = sorted(n for n in tensors if n not in covered and chunks[n])
    if missing:
        raise CheckpointError(f"{found / METADATA_FILE} lists no stored chunk for {missing[:5]}.")
    return meta.get("config", {}), tensors


def write_consolidated(out_dir: str | Path, config_dict: dict, tensors: dict[str, torch.Tensor],
                       extra_files: dict[str, bytes] | None = None) -> Path:
    """Write `tensors` (full, by parameter name) as a consolidated model directory any layout loads; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "COMPLETE").unlink(missing_ok=True)  # not a checkpoint until the new marker is written
    names = sorted(tensors)
    specs = [(name, tuple(tensors[name].shape), tensors[name].dtype) for name in names]
    with SequentialSafetensorsWriter(out / MODEL_FILE, specs) as writer:
        for name in names:
            writer.write(name, tensors[name])
    record = {"format": "fourfold-dcp-safetensors-1",
              "tensors": {name: {"dtype": str(tensors[name].dtype).removeprefix("torch."),
                                 "shape": list(tensors[name].shape),
                                 "chunks": [[[0] * tensors[name].dim(), list(tensors[name].shape)]]} for name in names},
              "storage": [{"fqn": name, "offset": [0] * tensors[name].dim(), "file": MODEL_FILE, "key": name}
                          for name in names]}
    write_json(out / METADATA_FILE, record)
    write_json(out / "meta.json", {"step": 0, "config": config_dict, "consolidated": True,
                                   "tokenizer": (config_dict.get("data") or {}).get("tokenizer")})
    for name, content in (extra_files or {}).items():
        (out / name).write_bytes(content)
    write_manifest(out, 0, {MODEL_FILE: {"bytes": writer.size, "sha256": writer.sha256}})
    return out


def extra_files_of(path: Path) -> dict[str, bytes]:
    """The files of a checkpoint that are neither tensors nor its bookkeeping (tokenizer, chat template, ...)."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())
            if p.is_file() and p.name not in BOOKKEEPING and not p.name.endswith(".safetensors")}


def consolidate(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """A sharded checkpoint (or run directory) -> one consolidated model directory, tokenizer files included."""
    found = find_checkpoint(checkpoint_dir)
    config, tensors = read_model_tensors(found)
    return write_consolidated(out_dir, config, tensors, extra_files_of(found))


def shard_consolidated(model_dir: str | Path, run_dir: str | Path, step: int = 0) -> Path:
    """The reverse: a consolidated model directory -> `run_dir/checkpoints/step_<step>`, loadable by any layout
    (the same files; a consolidated model already reshards, each rank reading only its block)."""
    found = find_checkpoint(model_dir)
    target = Path(run_dir) / "checkpoints" / f"step_{step}"
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(found, tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target
