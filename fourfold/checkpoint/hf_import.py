"""Import a Hugging Face Llama directory into a fourfold checkpoint directory (weights renamed, tokenizer copied).

    import_hf("SmolLM2-135M-Instruct/", "models/smollm2")            # then: fourfold generate --checkpoint ...

The source holds config.json, model.safetensors (or model.safetensors.index.json and its shards) and,
usually, tokenizer.json, tokenizer_config.json (with the chat template), generation_config.json. The
output is a complete fourfold checkpoint whose meta.json carries the [model] section mapped from
config.json (fourfold.models.hf) and `data.tokenizer` pointing at the tokenizer.json copied beside the
weights, so inference finds its tokenizer and chat template there. Only safetensors are read (no pickle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from fourfold.checkpoint.consolidated import write_consolidated
from fourfold.config import ModelConfig, TrainConfig
from fourfold.errors import CheckpointError, ConfigError
from fourfold.models.hf import config_from_hf, fourfold_name
from fourfold.models.llama import Llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; fourfold computes them


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` looks like a Hugging Face model directory (it has a config.json and no meta.json)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "meta.json").is_file()


def read_json(path: Path) -> dict:
    """A JSON file as a dict; CheckpointError naming it when missing or invalid."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is missing or not valid JSON ({e}).") from None


def weight_files(src: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: model.safetensors or those its index names."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [src / n for n in names]
    else:
        files = [src / "model.safetensors"] if (src / "model.safetensors").is_file() else []
    if not files:
        raise CheckpointError(f"{src} has neither model.safetensors nor model.safetensors.index.json; fourfold reads "
                              "safetensors weights only (convert pytorch_model.bin with transformers first).")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{src} names the weight file {f.name} in its index, but it is missing.")
    return files


def expected_shapes(model_section: dict) -> dict[str, tuple[int, ...]]:
    """fourfold name -> shape of every tensor the model of `model_section` holds (built on the meta device)."""
    with torch.device("meta"):
        model = Llama(ModelConfig(**model_section))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """CheckpointError naming missing, unexpected or mis-shaped tensors."""
    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {shapes[n]})" for n in shapes
             if n in tensors and tuple(tensors[n].shape) != shapes[n]]
    if missing or unexpected or wrong:
        parts = [f"missing {', '.join(missing[:5])}" if missing else "",
                 f"unexpected {', '.join(unexpected[:5])}" if unexpected else "",
                 f"wrong shape {', '.join(wrong[:5])}" if wrong else ""]
        raise CheckpointError(f"The weights of {source} do not match its config: "
                              f"{'; '.join(p for p in parts if p)}.")


def finish_tensors(tensors: dict[str, torch.Tensor], model_section: dict, source: str,
                   dtype: str | None) -> dict[str, torch.Tensor]:
    """Tie the head to the embedding when the config says so, check names and shapes, cast to `dtype`."""
    if model_section["tie_embeddings"] and "tok_embeddings.weight" in tensors:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]  # a stored lm_head copy, if any, is the same
    check_tensors(tensors, expected_shapes(model_section), source)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}.")
        tensors = {n: t.to(DTYPES[dtype]) for n, t in tensors.items()}
    return tensors


def read_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every weight of a Hugging Face Llama directory under its fourfold name."""
    tensors: dict[str, torch.Tensor] = {}
    unknown = []
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                try:
                    tensors[fourfold_name(name)] = f.get_tensor(name)
                except KeyError:
                    unknown.append(name)
    if unknown:
        raise CheckpointError(f"{src} holds weights fourfold's Llama has no place for ({', '.join(unknown[:5])}"
                              f"{', ...' if len(unknown) > 5 else ''}); the architecture is not plain Llama.")
    return tensors


def tokenizer_files(src: Path) -> dict[str, bytes]:
    """The tokenizer and generation files of `src`; a separate chat_template.jinja is folded into tokenizer_config."""
    files = {name: (src / name).read_bytes() for name in TOKENIZER_FILES if (src / name).is_file()}
    jinja = src / "chat_template.jinja"
    if jinja.is_file():
        config = json.loads(files.get("tokenizer_config.json", b"{}"))
        config.setdefault("chat_template", jinja.read_text())
        files["tokenizer_config.json"] = json.dumps(config, indent=1).encode()
    return files


def own_tokenizer(checkpoint_dir: str | Path, spec: str) -> str:
    """The tokenizer a checkpoint's model should use: its own tokenizer.json when it carries one, else `spec`.

    Imported checkpoints record the absolute path of their copy in `data.tokenizer`; loaders that call
    this keep working after the directory is moved or copied to another machine.
    """
    own = Path(checkpoint_dir) / "tokenizer.json"
    return str(own) if own.is_file() else spec


def run_config(model_section: dict, out_dir: Path, has_tokenizer: bool) -> dict:
    """The config saved in meta.json: the model, its own tokenizer, a sequence length the model covers."""
    config = {"model": model_section, "train": {"seq_len": min(TrainConfig().seq_len, model_section["max_seq_len"])}}
    if has_tokenizer:
        # An absolute path, so `fourfold generate --checkpoint DIR` finds it from any working directory.
        config["data"] = {"tokenizer": str(out_dir.resolve() / "tokenizer.json")}
    return config


def read_hf_model(src_dir: str | Path, dtype: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(fourfold [model] section, fourfold name -> tensor) of a Hugging Face Llama directory, checked and tied.

    What `init_from` or an inference loader needs to build and fill a fourfold Llama from a Hugging Face
    directory in memory, without writing a checkpoint. `dtype` as in `import_hf`.
    """
    src = Path(src_dir)
    model_section = config_from_hf(read_json(src / "config.json"))
    return model_section, finish_tensors(read_hf_tensors(src), model_section, str(src), dtype)


def import_hf(src_dir: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Import the Hugging Face Llama directory `src_dir` as the fourfold checkpoint directory `out_dir`.

    `dtype` ('fp32', 'bf16', 'fp16') casts the weights; None keeps the stored dtype. Returns `out_dir`.
    ConfigError for an architecture fourfold does not implement, CheckpointError for missing or bad files.
    """
    src, out = Path(src_dir), Path(out_dir)
    model_section, tensors = read_hf_model(src, dtype)
    extra = tokenizer_files(src)
    return write_consolidated(out, run_config(model_section, out, "tokenizer.json" in extra), tensors, extra)
