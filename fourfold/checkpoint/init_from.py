"""Starting a run from another run's weights (`[checkpoint] init_from`): its model shape, then its weights.

    cfg = config_with_init_model(cfg)            # [model] taken from the checkpoint's saved config
    meta = load_init_weights(path, modules)      # model tensors only, resharded to this rank's layout

Only the model's weights are taken: optimizer state, step, data position and loss scale start fresh.
`path` is a checkpoint directory, a run directory (its newest complete checkpoint), a consolidated
model directory (`fourfold.checkpoint.consolidated`) or a Hugging Face Llama directory: its shape comes
from config.json, and rank 0 imports its weights once into `<run dir>/init-from-hf/` (a consolidated
model, `fourfold.checkpoint.hf_import`), which every rank then loads under its own layout like any
checkpoint.

Explicit [model] keys: a value in the run's config that differs both from ModelConfig's default and from
the checkpoint's is a ConfigError naming the key; a value left at its default takes the checkpoint's.
With data.tokenizer left at 'byte', a source that carries a tokenizer.json (an imported or Hugging Face
model) trains with that tokenizer, and so with the chat template beside it (data.chat_template = auto).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

from fourfold.checkpoint.hf_import import import_hf, is_hf_dir, own_tokenizer, read_json
from fourfold.checkpoint.listing import find_checkpoint
from fourfold.checkpoint.store import checkpoint_at, load_checkpoint, read_meta
from fourfold.models.hf import config_from_hf
from fourfold.config import Config, ModelConfig
from fourfold.errors import CheckpointError, ConfigError


def init_checkpoint(path: str | Path) -> Path:
    """The complete checkpoint `path` names (a checkpoint, run or consolidated directory)."""
    return find_checkpoint(path, setting="checkpoint.init_from")


def saved_model_config(path: str | Path) -> dict:
    """The [model] section a checkpoint was trained with (or a Hugging Face directory describes), as a dict."""
    if is_hf_dir(path):
        return config_from_hf(read_json(Path(path) / "config.json"))
    found = init_checkpoint(path)
    try:
        return dict(read_meta(found)["config"]["model"])
    except (KeyError, TypeError):
        raise CheckpointError(f"{found / 'meta.json'} holds no config with a [model] section; cannot tell the "
                              "model's shape.") from None


def config_with_init_model(cfg: Config) -> Config:
    """`cfg` with its [model] section from checkpoint.init_from's saved config (`cfg` itself if it is unset)."""
    if not cfg.checkpoint.init_from:
        return cfg
    saved = saved_model_config(cfg.checkpoint.init_from)
    defaults = dataclasses.asdict(ModelConfig())
    mine = dataclasses.asdict(cfg.model)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for key, value in mine.items():
        if key == "preset" or key not in saved:
            continue
        if value != defaults[key] and value != saved[key]:
            raise ConfigError(f"model.{key} = {value!r} disagrees with the checkpoint in checkpoint.init_from "
                              f"({cfg.checkpoint.init_from}), which has {saved[key]!r}; the model shape comes "
                              f"from the checkpoint: drop model.{key} or set it to {saved[key]!r}.")
    model = ModelConfig(**{k: v for k, v in saved.items() if k in known})
    data = cfg.data
    own = init_tokenizer(cfg.checkpoint.init_from)
    if data.tokenizer == "byte" and own is not None:  # an imported model trains with its own tokenizer
        data = dataclasses.replace(data, tokenizer=own)
    return dataclasses.replace(cfg, model=model, data=data)


def init_tokenizer(path: str | Path) -> str | None:
    """The tokenizer the weights at `path` were trained with: a Hugging Face directory's tokenizer.json, or the
    non-byte data.tokenizer in a checkpoint's saved config (its own copy when it carries one); else None."""
    if is_hf_dir(path):
        own = Path(path) / "tokenizer.json"
        return str(own) if own.is_file() else None
    found = init_checkpoint(path)
    saved = (read_meta(found).get("config") or {}).get("data", {}).get("tokenizer", "byte")
    return None if saved == "byte" else own_tokenizer(found, saved)


def load_init_weights(path: str | Path, modules, run_dir: str | Path) -> dict:
    """Load the model weights at `path` into `modules` (any layout; collective); the checkpoint's meta.

    A Hugging Face directory is first imported by rank 0 into `run_dir`/init-from-hf (kept, so the run
    records exactly which weights it started from).
    """
    if is_hf_dir(path):
        imported = Path(run_dir) / "init-from-hf"
        if (not dist.is_initialized() or dist.get_rank() == 0) and checkpoint_at(imported) is None:
            import_hf(path, imported)
        if dist.is_initialized():
            dist.barrier()
        path = imported
    return load_checkpoint(init_checkpoint(path), modules, optimizer=None)
