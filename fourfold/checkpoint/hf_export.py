"""Export a fourfold checkpoint as a Hugging Face Llama directory that `LlamaForCausalLM.from_pretrained` loads.

    export_hf("runs/x", "hf/x")          # a checkpoint directory, or a run directory (its newest checkpoint)

Writes config.json (fourfold.models.hf.config_to_hf), model.safetensors (Hugging Face names; the head left
out when tied to the embedding, as transformers saves it) and the tokenizer files: those stored in the
checkpoint (an imported model's), else the tokenizer.json the run was trained with.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fourfold.checkpoint.hf_import import DTYPES, TOKENIZER_FILES
from fourfold.checkpoint.consolidated import read_model_tensors
from fourfold.checkpoint.store import checkpoint_at
from fourfold.config import ModelConfig
from fourfold.errors import CheckpointError, ConfigError
from fourfold.models.hf import config_to_hf, hf_name

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_tensors(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """fourfold tensors under their Hugging Face names, contiguous; the head dropped when tied."""
    return {hf_name(n): t.contiguous() for n, t in tensors.items() if not (tied and n == "output.weight")}


def special_ids(files: dict[str, bytes]) -> dict:
    """bos/eos/pad token ids from generation_config.json, for config.json."""
    if "generation_config.json" not in files:
        return {}
    generation = json.loads(files["generation_config.json"])
    return {k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in generation}


def tokenizer_files(ckpt: Path, config: dict) -> dict[str, bytes]:
    """The checkpoint's own tokenizer files, else those of the run's data.tokenizer (the tokenizer.json and the
    tokenizer_config.json / generation_config.json beside it: a fine-tuned import keeps its chat template and
    end-of-turn id); none for the byte tokenizer."""
    files = {n: (ckpt / n).read_bytes() for n in TOKENIZER_FILES if (ckpt / n).is_file()}
    spec = config.get("data", {}).get("tokenizer", "byte")
    if "tokenizer.json" not in files and spec != "byte" and Path(spec).is_file():
        for name in TOKENIZER_FILES:
            sibling = Path(spec).with_name(name)
            if name not in files and sibling.is_file():
                files[name] = sibling.read_bytes()
    return files


def export_hf(src: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the fourfold checkpoint (or run directory) `src` as a Hugging Face Llama directory `out_dir`.

    `dtype` ('fp32', 'bf16', 'fp16') casts the weights; None keeps the stored dtype. Returns `out_dir`.
    """
    config, tensors = read_model_tensors(src)
    ckpt = checkpoint_at(src)
    try:
        model = ModelConfig(**config["model"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'} has no usable [model] config ({e}).") from None
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}.")
        tensors = {n: t.to(DTYPES[dtype]) for n, t in tensors.items()}
    weights = hf_tensors(tensors, model.tie_embeddings)
    stored = next(iter(weights.values())).dtype
    files = tokenizer_files(ckpt, config)
    hf_config = config_to_hf(model, HF_DTYPE_NAMES.get(stored, "float32"), special_ids(files))

    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    for name, content in files.items():
        (tmp / name).write_bytes(content)
    if out.exists():
        if any(out.iterdir()):
            raise CheckpointError(f"{out} is not empty; choose an empty or new output directory.")
        out.rmdir()
    os.rename(tmp, out)
    return out
