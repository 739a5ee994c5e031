"""Load a model for inference: one function the engine, `LLM`, `fourfold generate` and `fourfold serve` call.

    loaded = load_model("runs/tiny", torch.device("cpu"), torch.bfloat16)
    loaded.model, loaded.tokenizer, loaded.name, loaded.chat_template, loaded.eos_id

Today it reads fourfold checkpoints: a `checkpoints/step_N` directory or a run directory (its newest
checkpoint); the model config comes from meta.json, the tokenizer from data.tokenizer. This is the seam
where Hugging Face directories and quantized (low-bit converted) models plug in: add a branch that
recognises the directory and returns the same LoadedModel.

With a tensor-parallel mesh the model is built on the meta device, sharded (fourfold's tensor plan:
column-parallel q/k/v/w1/w3, row-parallel wo/w2, one all-reduce per block half), and then each rank
allocates and reads only its own shards from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fourfold.chat import ChatTemplate
from fourfold.checkpoint.store import checkpoint_at, load_checkpoint, read_meta
from fourfold.config import Config, build_config
from fourfold.errors import CheckpointError, ConfigError
from fourfold.infer.cpu_linear import pack_cpu_linears
from fourfold.models.llama import Llama
from fourfold.parallel.pipeline.split import split_pipeline, stage_layers
from fourfold.parallel.tensor import apply_tensor_parallel
from fourfold.tokenizer import load_tokenizer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64}


@dataclass
class LoadedModel:
    """A model ready for the engine and what serving it needs besides the weights."""

    model: nn.Module
    tokenizer: object
    name: str
    chat_template: ChatTemplate
    eos_id: int | None
    config: Config | None = None
    kv_heads: int = 0
    """KV heads this rank's cache holds (all of them without tensor parallel)."""
    layers: range | None = None
    """Indices of the blocks this rank holds (all of them without pipeline parallel)."""


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A torch dtype from a name; None picks bf16 on CUDA and fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not known; use one of bf16, fp16 or fp32.")
    return DTYPES[dtype]


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory."""
    latest = checkpoint_at(path)
    if latest is None:
        raise CheckpointError(f"No checkpoint found at '{path}': pass a checkpoints/step_N directory or a run "
                              "directory that has one (train with checkpoint.save_final = true).")
    return latest


def _chat_template(ckpt: Path) -> ChatTemplate:
    """The template of the checkpoint's or its run's tokenizer_config.json, else the default."""
    for d in (ckpt, ckpt.parent.parent):
        if (d / "tokenizer_config.json").is_file():
            return ChatTemplate.for_model_dir(d)
    return ChatTemplate()


def load_model(path: str | Path, device: torch.device, dtype: str | torch.dtype | None = None,
               tp_mesh: DeviceMesh | None = None, pp: tuple[int, int] | None = None,
               pack_cpu: bool = True) -> LoadedModel:
    """The model at `path` on `device` in `dtype`, eval mode, sharded over `tp_mesh` when given;
    with `pp` = (stage, stages) only that pipeline stage's chunk. `pack_cpu`: bf16 linears on the CPU
    run on weights packed once for oneDNN (fourfold.infer.cpu_linear; the model is then inference-only)."""
    dtype = parse_dtype(dtype, device)
    ckpt = find_checkpoint(path)
    saved = read_meta(ckpt).get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt / 'meta.json'} has no model config; it was not written by fourfold train.")
    # The parallel layout of training does not apply to inference.
    cfg = build_config({k: v for k, v in saved.items() if k != "parallel"})
    with torch.device("meta"):
        model = Llama(cfg.model)
    layers = range(cfg.model.n_layers)
    if pp is not None:
        model = split_pipeline(model, pp[0], pp[1])[0]
        layers = stage_layers(cfg.model.n_layers, pp[1], 1, pp[0])
    tp = 1
    if tp_mesh is not None:
        tp = tp_mesh.size()
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)
    model.to_empty(device=device)
    tied = cfg.model.tie_embeddings and model.output is not None and model.tok_embeddings is not None
    if tied and model.output.weight is not model.tok_embeddings.weight:
        model.output.weight = model.tok_embeddings.weight
    model.init_weights(0)  # rotary tables (and values the checkpoint overwrites)
    load_checkpoint(ckpt, model, None)
    model = model.to(dtype).eval()
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    if pack_cpu and device.type == "cpu" and tp_mesh is None:
        pack_cpu_linears(model)  # bf16 only; a no-op for other dtypes
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    name = Path(path).resolve().name
    return LoadedModel(model, tokenizer, name, _chat_template(ckpt), getattr(tokenizer, "eos_id", None), cfg,
                       cfg.model.n_kv_heads // tp, layers)
