"""`fourfold eval`: held-out perplexity (per token and per word) of any checkpoint: full precision, QAT or converted.

    fourfold eval --checkpoint runs/tiny [--data PATH] [--max-sequences 256] [--batch 8] [--device cpu] [--json]

The held-out text is the validation split (the last data.val_fraction of the windows) of the corpus the
checkpoint was trained on, or of --data. Token perplexity is exp(mean negative log-likelihood per
predicted token); word perplexity is exp(total negative log-likelihood / number of whitespace-separated
words in the predicted text), which compares models with different tokenizers (as lm-eval's wikitext
word_perplexity does). A QAT checkpoint (config quant.qat) is evaluated fake-quantized, as it trained; a
converted one (meta.json "quant") with its packed low-bit modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import CheckpointError, ConfigError


def load_model(path: str | Path, device: torch.device):
    """(model in eval mode on `device`, Config, meta) for a checkpoint or a run directory's newest checkpoint."""
    from fourfold.checkpoint.listing import find_checkpoint
    from fourfold.checkpoint.store import load_checkpoint, read_meta
    from fourfold.config import build_config
    from fourfold.models.llama import Llama
    from fourfold.quant.qat import apply_checkpoint_quant, check_device_runs
    from fourfold.quant.schemes import scheme_by_name

    ckpt = find_checkpoint(path)
    meta = read_meta(ckpt)
    if "config" not in meta:
        raise CheckpointError(f"{ckpt / 'meta.json'} has no \"config\"; it is not a fourfold training checkpoint.")
    cfg = build_config({k: v for k, v in meta["config"].items() if k != "parallel"})
    if meta.get("quant"):
        check_device_runs(scheme_by_name(meta["quant"].get("scheme", "?")), device)
    model = apply_checkpoint_quant(Llama(cfg.model), meta)
    load_checkpoint(ckpt, model, None)
    return model.to(device).eval(), cfg, meta


def corpus_windows(cfg, data_path: str | None = None, split: str = "val"):
    """(tokenizer, PackedSequences of `split`) of the config's corpus, or of `data_path`: "val" is the held-out
    split `fourfold eval` scores, "train" the rest (what `fourfold quantize --method gptq` calibrates on)."""
    from fourfold.tokenizer import load_tokenizer
    from fourfold.train.dataset import PackedSequences, check_data_source, token_file

    data = dataclasses.replace(cfg.data, path=data_path if data_path is not None else cfg.data.path)
    cfg = dataclasses.replace(cfg, data=data)
    check_data_source(cfg)
    tokenizer = load_tokenizer(data.tokenizer)
    windows = PackedSequences(token_file(data, tokenizer), cfg.train.seq_len, split, data.val_fraction)
    if len(windows) == 0:
        raise ConfigError("The held-out split is empty: data.val_fraction is 0 or the corpus is too small; pass "
                          "--data with more text." if split == "val" else
                          "The corpus has no training windows outside the held-out split; pass --data with more text.")
    return tokenizer, windows


@torch.no_grad()
def perplexity(model, windows, tokenizer, *, max_sequences: int = 0, batch: int = 8,
               device: torch.device = torch.device("cpu")) -> dict:
    """Token and word perplexity of `model` on `windows` (seq_len + 1 token ids each), the first max_sequences."""
    n = len(windows) if max_sequences <= 0 else min(max_sequences, len(windows))
    nll, tokens, words = 0.0, 0, 0
    for start in range(0, n, batch):
        rows = torch.stack([windows[i] for i in range(start, min(n, start + batch))]).to(device)
        logits = model(rows[:, :-1])
        losses = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        nll += float(losses)
        tokens += rows[:, 1:].numel()
        words += sum(len(tokenizer.decode(r[1:].tolist()).split()) for r in rows.cpu())
    return {"token_ppl": math.exp(nll / tokens), "word_ppl": math.exp(nll / max(words, 1)),
            "nll_per_token": nll / tokens, "tokens": tokens, "words": words, "sequences": n}


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold eval", description="Held-out perplexity of a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory (newest checkpoint)")
    p.add_argument("--data", default=None, help="text file, directory or glob (default: the checkpoint's corpus)")
    p.add_argument("--max-sequences", type=int, default=256, help="held-out windows to score; 0 for all")
    p.add_argument("--batch", type=int, default=8, help="windows per forward, at least 1")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    return p


def main(argv: list[str], console: Console) -> int:
    """`fourfold eval`: print the held-out token and word perplexity of a checkpoint; return 0."""
    from fourfold.distributed import pick_device

    a = _parser().parse_args(argv)
    if a.max_sequences < 0 or a.batch < 1:
        raise ConfigError("--max-sequences must be at least 0 (0 scores all) and --batch at least 1.")
    device = pick_device(a.device, flag="--device")
    model, cfg, meta = load_model(a.checkpoint, device)
    tokenizer, val = corpus_windows(cfg, a.data)
    result = perplexity(model, val, tokenizer, max_sequences=a.max_sequences, batch=a.batch, device=device)
    kind = (f"converted {meta['quant']['scheme']}" if meta.get("quant")
            else f"QAT {cfg.quant.qat} (fake-quant)" if cfg.quant.qat else "full precision")
    result = {"checkpoint": str(a.checkpoint), "model": kind, **result}
    if a.json:
        print(json.dumps(result))
    else:
        console.print(f"{kind}: token perplexity {result['token_ppl']:.4f}, word perplexity "
                      f"{result['word_ppl']:.3f} ({result['tokens']} tokens, {result['words']} words, "
                      f"{result['sequences']} held-out sequences)")
    return 0
