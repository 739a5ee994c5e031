"""`fourfold generate`: load a checkpoint and continue a prompt with a KV-cached sampling loop."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fourfold.checkpoint.store import latest_checkpoint, load_checkpoint
from fourfold.config import Config, build_config
from fourfold.errors import CheckpointError
from fourfold.infer.kv_cache import KVCache, cached_forward
from fourfold.infer.sampling import sample_next
from fourfold.models.llama import Llama
from fourfold.tokenizer import load_tokenizer


@dataclass
class SamplingOptions:
    """How tokens are picked: temperature 0 is greedy."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    seed: int = 0


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory."""

    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(f"No checkpoint found at '{p}': pass a checkpoints/step_N directory or a run "
                              "directory that has one (train with checkpoint.save_final = true).")
    return latest


def load_for_inference(path: str | Path, device: torch.device) -> tuple[Llama, Config]:
    """Build the model a checkpoint was trained with and load its weights (safetensors, no pickle)."""

    ckpt = find_checkpoint(path)
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        saved = meta["config"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'} is missing or invalid ({e}).") from None
    # The parallel layout of training does not apply to generation in one process.
    cfg = build_config({k: v for k, v in saved.items() if k != "parallel"})
    model = Llama(cfg.model)
    load_checkpoint(ckpt, model, None)
    return model.to(device).eval(), cfg


@torch.no_grad()
def generate(model: Llama, prompt_ids: list[int], options: SamplingOptions, device: torch.device,
             eos_id: int | None = None) -> list[int]:
    """Prompt ids in, generated ids out (prompt excluded), stopping at eos or max_new_tokens."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    prompt_ids = prompt_ids[-(model.cfg.max_seq_len - 1):]
    cache_len = min(model.cfg.max_seq_len, len(prompt_ids) + options.max_new_tokens)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model, 1, cache_len, device, dtype)
    gen = torch.Generator(device=device).manual_seed(options.seed)
    tokens = torch.tensor([prompt_ids], device=device)
    logits = cached_forward(model, tokens, cache, 0)
    pos, out = tokens.shape[1], []
    while True:
        nxt = sample_next(logits, options.temperature, options.top_k, options.top_p, gen)
        out.append(int(nxt))
        done = eos_id is not None and out[-1] == eos_id
        if done or len(out) >= options.max_new_tokens or pos >= cache_len:
            break
        logits = cached_forward(model, nxt.view(1, 1), cache, pos)
        pos += 1
    return out


def generate_text(checkpoint: str | Path, prompt: str, options: SamplingOptions, device: torch.device) -> str:
    """Load a checkpoint (or a run directory's newest) and return a sampled continuation of `prompt` as text."""

    model, cfg = load_for_inference(checkpoint, device)
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = generate(model, tok.encode(prompt), options, device, tok.eos_id)
    return tok.decode(ids)
