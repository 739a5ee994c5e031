"""Load a model for inference: one function the engine, `LLM`, `fourfold generate` and `fourfold serve` call.

    loaded = load_model("runs/tiny", torch.device("cpu"), torch.bfloat16)
    loaded.model, loaded.tokenizer, loaded.name, loaded.chat_template, loaded.eos_id

It reads fourfold checkpoints (a `checkpoints/step_N`, run or consolidated directory: the config from
meta.json, the tokenizer from the checkpoint's own tokenizer.json or data.tokenizer) and Hugging Face Llama
directories (read in memory through fourfold.checkpoint.hf_import; one process). The reply ends at
generation_config.json's eos_token_id when there is one (a chat model's end-of-turn token).

With a tensor-parallel mesh the model is built on the meta device, sharded (fourfold's tensor plan:
column-parallel q/k/v/w1/w3, row-parallel wo/w2, one all-reduce per block half), and then each rank
allocates and reads only its own shards from the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fourfold.chat import ChatTemplate
from fourfold.checkpoint.hf_import import is_hf_dir, own_tokenizer, read_hf_model, run_config
from fourfold.checkpoint.listing import find_checkpoint
from fourfold.checkpoint.store import checkpoint_at, load_checkpoint, read_meta
from fourfold.config import Config, build_config
from fourfold.errors import CheckpointError, ConfigError
from fourfold.infer.cpu_linear import pack_cpu_linears
from fourfold.models.llama import Llama
from fourfold.parallel.pipeline.split import split_pipeline, stage_layers
from fourfold.parallel.tensor import apply_tensor_parallel
from fourfold.quant.qat import apply_checkpoint_quant
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


def _chat_template(ckpt: Path, tokenizer_spec: str) -> ChatTemplate:
    """The template of the checkpoint's, its run's or its tokenizer's tokenizer_config.json, else the default."""
    beside = [Path(tokenizer_spec).parent] if tokenizer_spec != "byte" else []
    for d in (ckpt, ckpt.parent.parent, *beside):
        if (d / "tokenizer_config.json").is_file():
            return ChatTemplate.for_model_dir(d)
    return ChatTemplate()


def _eos_id(ckpt: Path, tokenizer, tokenizer_spec: str = "byte") -> int | None:
    """The id that ends a reply: generation_config.json's eos_token_id (the first, when it lists several; for
    chat models the end-of-turn token) from the checkpoint or beside its tokenizer, else the tokenizer's
    end-of-text token."""
    candidates = [ckpt / "generation_config.json"]
    if tokenizer_spec != "byte":
        candidates.append(Path(tokenizer_spec).with_name("generation_config.json"))
    config = next((c for c in candidates if c.is_file()), None)
    if config is not None:
        try:
            eos = json.loads(config.read_text()).get("eos_token_id")
        except ValueError:
            eos = None
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
    return getattr(tokenizer, "eos_id", None)


def _hf_source(path: Path, tp_mesh, pp) -> tuple[Path, dict, dict[str, torch.Tensor]] | None:
    """(directory, saved config, tensors) for a Hugging Face directory, read in memory; None for fourfold's."""
    if not is_hf_dir(path) or checkpoint_at(path) is not None:
        return None
    if tp_mesh is not None or pp is not None:
        raise ConfigError(f"{path} is a Hugging Face directory; tensor- or pipeline-parallel inference reads "
                          "fourfold checkpoints: import it first with `fourfold convert {path} DIR`.")
    model_section, tensors = read_hf_model(path)
    return Path(path), run_config(model_section, Path(path), (Path(path) / "tokenizer.json").is_file()), tensors


def load_model(path: str | Path, device: torch.device, dtype: str | torch.dtype | None = None,
               tp_mesh: DeviceMesh | None = None, pp: tuple[int, int] | None = None,
               pack_cpu: bool = True) -> LoadedModel:
    """The model at `path` on `device` in `dtype`, eval mode, sharded over `tp_mesh` when given;
    with `pp` = (stage, stages) only that pipeline stage's chunk. `pack_cpu`: bf16 linears on the CPU
    run on weights packed once for oneDNN (fourfold.infer.cpu_linear; the model is then inference-only)."""
    dtype = parse_dtype(dtype, device)
    hf = _hf_source(Path(path), tp_mesh, pp)
    ckpt = hf[0] if hf else find_checkpoint(path)
    saved = hf[1] if hf else read_meta(ckpt).get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt / 'meta.json'} has no model config; it was not written by fourfold train.")
    # The parallel layout of training does not apply to inference.
    cfg = build_config({k: v for k, v in saved.items() if k != "parallel"})
    with torch.device("meta"):
        model = Llama(cfg.model)
    meta = {} if hf else read_meta(ckpt)
    if meta.get("quant") and (tp_mesh is not None or pp is not None):
        raise ConfigError(f"{ckpt} holds a low-bit converted model; tensor- and pipeline-parallel inference "
                          "run float checkpoints only: serve it with one process (--tp 1).")
    apply_checkpoint_quant(model, meta)  # converted: empty packed modules the load fills; QAT: fake-quant layers
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
    if hf:
        missing, unexpected = model.load_state_dict(hf[2], strict=False)
        if [k for k in missing if not k.startswith("rope_")] or unexpected:
            raise CheckpointError(f"{ckpt} does not fit the model its config.json describes (missing "
                                  f"{missing[:3]}, unexpected {unexpected[:3]}).")
    else:
        load_checkpoint(ckpt, model, None)
    model = model.to(dtype).eval()
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    if pack_cpu and device.type == "cpu" and tp_mesh is None:
        pack_cpu_linears(model)  # bf16 only; a no-op for other dtypes
    tokenizer_spec = own_tokenizer(ckpt, cfg.data.tokenizer)  # a moved import still finds its own
    tokenizer = load_tokenizer(tokenizer_spec)
    name = Path(path).resolve().name
    return LoadedModel(model, tokenizer, name, _chat_template(ckpt, tokenizer_spec),
                       _eos_id(ckpt, tokenizer, tokenizer_spec), cfg, cfg.model.n_kv_heads // tp, layers)
