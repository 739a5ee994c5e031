"""A whole model on disk as fourfold stores it: full tensors by fourfold name in safetensors, config in meta.json.

    write_consolidated(out_dir, {"model": {...}, "data": {...}}, tensors, extra_files={"tokenizer.json": b"..."})
    config, tensors = read_model_tensors("runs/x")  # a checkpoint directory or a run directory (newest one)
    consolidate("runs/x", "out/model")              # the two above, plus the checkpoint's tokenizer files

The importers and exporters (hf_import, hf_export, gguf_import, `fourfold convert`) go through these three
functions only; they have the signatures of fourfold.checkpoint.consolidated (the sharded DCP format), which
replaces this module when both are merged. The directory written is a complete
fourfold checkpoint (`model-model.safetensors`, `meta.json` with `config`, `step` 0 and `shards`) that
`fourfold generate --checkpoint DIR` loads; it appears only when complete (written beside, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fourfold.checkpoint.safetensors_io import TensorReader
from fourfold.checkpoint.store import checkpoint_at, read_meta
from fourfold.errors import CheckpointError

SHARD = "model"


def write_consolidated(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write a one-shard fourfold checkpoint of `tensors` (fourfold names) with `config` in meta.json."""
    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seen: set[int] = set()
    owned = {}
    for name, t in tensors.items():  # tied weights share storage; safetensors wants each stored once
        t = t.detach().contiguous()
        owned[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    save_file(owned, str(tmp / f"model-{SHARD}.safetensors"))
    for name, content in (extra_files or {}).items():
        (tmp / name).write_bytes(content)
    (tmp / "meta.json").write_text(json.dumps({"config": config, "step": 0, "shards": [SHARD]}, indent=1))
    if out.exists():
        if any(out.iterdir()):
            raise CheckpointError(f"{out} is not empty; choose an empty or new output directory.")
        out.rmdir()
    os.rename(tmp, out)
    return out


def read_model_tensors(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, fourfold name -> full tensor) of a checkpoint directory or a run directory (its newest)."""
    ckpt = checkpoint_at(path)
    if ckpt is None:
        raise CheckpointError(f"No fourfold checkpoint at '{path}': pass a checkpoint directory (holding meta.json) "
                              "or a run directory that has one.")
    meta = read_meta(ckpt)
    if "config" not in meta:
        raise CheckpointError(f"{ckpt / 'meta.json'} has no 'config'; this is not a fourfold model checkpoint.")
    files = [ckpt / f"model-{shard}.safetensors" for shard in meta["shards"]]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"Checkpoint {ckpt} lists shard file {f.name}, which is missing.")
    reader = TensorReader(files)
    return meta["config"], {name: reader.get(name) for name in reader.names()}


def extra_files_of(path: str | Path) -> dict[str, bytes]:
    """The files of checkpoint `path` that are neither tensors nor bookkeeping (tokenizer, chat template, ...)."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())
            if p.is_file() and p.name != "meta.json" and not p.name.endswith(".safetensors")
            and not p.name.startswith("optim-")}


def consolidate(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """A checkpoint (or run directory) -> one single-file model directory, tokenizer files included."""
    found = checkpoint_at(checkpoint_dir)
    if found is None:
        raise CheckpointError(f"No fourfold checkpoint at '{checkpoint_dir}'.")
    config, tensors = read_model_tensors(found)
    return write_consolidated(out_dir, config, tensors, extra_files_of(found))
