"""A contiguous-KV-cache generation loop (a second reference for the engine's tests; the CLI uses the engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fourfold.checkpoint.store import load_checkpoint
from fourfold.config import Config, build_config
from fourfold.errors import CheckpointError
from fourfold.infer.kv_cache import KVCache
from fourfold.infer.loading import find_checkpoint
from fourfold.infer.sampling import sample_next
from fourfold.models.llama import Llama
from fourfold.quant.qat import apply_checkpoint_quant
from fourfold.tokenizer import load_tokenizer


@dataclass
class SamplingOptions:
    """How tokens are picked: temperature 0 is greedy."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    seed: int = 0


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
    model = apply_checkpoint_quant(Llama(cfg.model), meta)   # packed low-bit or fake-quant layers, if any
    load_checkpoint(ckpt, model, None)
    return model.to(device).eval(), cfg


def pad_prompts(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (batch, longest), lengths (batch,)): the prompts right-padded with token 0."""
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], device=device)


@torch.no_grad()
def generate_batch(model: Llama, prompts: list[list[int]], options: SamplingOptions, device: torch.device,
                   eos_id: int | None = None) -> list[list[int]]:
    """Continue several prompts together (any lengths); each gets its generated ids, prompt excluded.

    A sequence stops at eos, after max_new_tokens, or when it fills the model's context; the batch runs
    until every sequence has stopped. One forward per step over the whole batch, through the model's
    own forward with a contiguous KV cache; the head runs only on each sequence's newest token.
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    limit = model.cfg.max_seq_len
    prompts = [list(p)[-(limit - 1):] for p in prompts]
    tokens, lengths = pad_prompts(prompts, device)
    batch, longest = tokens.shape
    cache_len = min(limit, longest + options.max_new_tokens)
    cache = KVCache(len(model.layers), batch, cache_len)
    gen = torch.Generator(device=device).manual_seed(options.seed)
    rows = torch.arange(batch, device=device)

    positions = torch.arange(longest, device=device).expand(batch, -1)
    logits = model(tokens, positions, cache=cache.step(positions), logits_for=rows * longest + lengths - 1)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    while True:
        nxt = sample_next(logits, options.temperature, options.top_k, options.top_p, gen)
        for row, token in enumerate(nxt.tolist()):
            if done[row]:
                continue
            outs[row].append(token)
            next_position = len(prompts[row]) + len(outs[row]) - 1  # where the new token goes
            done[row] = (token == eos_id or len(outs[row]) >= options.max_new_tokens
                         or next_position >= cache_len)
        if all(done):
            return outs
        # Each sequence feeds its newest token at its own position; stopped ones rewrite their last slot.
        fed = torch.tensor([len(p) + len(o) - 1 for p, o in zip(prompts, outs)], device=device)
        positions = fed.clamp(max=cache_len - 1)[:, None]
        logits = model(nxt[:, None], positions, cache=cache.step(positions), logits_for=rows)


def generate(model: Llama, prompt_ids: list[int], options: SamplingOptions, device: torch.device,
             eos_id: int | None = None) -> list[int]:
    """Prompt ids in, generated ids out (prompt excluded), stopping at eos or max_new_tokens."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    return generate_batch(model, [prompt_ids], options, device, eos_id)[0]


def generate_text(checkpoint: str | Path, prompt: str, options: SamplingOptions, device: torch.device) -> str:
    """Load a checkpoint (or a run directory's newest) and return a sampled continuation of `prompt` as text."""

    model, cfg = load_for_inference(checkpoint, device)
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = generate(model, tok.encode(prompt), options, device, tok.eos_id)
    return tok.decode(ids)
