"""Tiny trainer runs for tests and benchmarks: a config and corpus, a per-rank target, and reading results.

    cfg = tiny_config(tmp, **{"parallel.fsdp": 2})          # tiny model, small batch, corpus in tmp
    run_ranks(train_on_rank, 2, args=(str(tmp), {"parallel.fsdp": 2}, "fsdp2"))
    losses(tmp / "fsdp2"), grad_norms(tmp / "fsdp2"), final_weights(tmp / "fsdp2")
"""

from __future__ import annotations

import os
from pathlib import Path

from fourfold.checkpoint.consolidated import read_model_tensors
from fourfold.checkpoint.store import latest_checkpoint
from fourfold.config import Config, build_config
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import train

TINY_MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=320, max_seq_len=64)


def write_corpus(path: Path, n_bytes: int = 40_000) -> Path:
    """A deterministic text file with some structure (so loss falls) and enough tokens for a few steps.

    Written to a temporary name and renamed, so a rank that finds the file finds all of it.
    """
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "print", "value"]
    lines, size, i = [], 0, 0
    while size < n_bytes:
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 9)) + f" {i % 97}")
        size += len(lines[-1]) + 1
        i += 1
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text("\n".join(lines))
    os.replace(partial, path)
    return path


def tiny_config(tmp: Path, **overrides) -> Config:
    """A config for trainer tests: tiny model, small batch, a corpus in `tmp`, no progress bar.

    `overrides` are dotted keys (`**{"parallel.tp": 2}`), applied last.
    """
    tmp = Path(tmp)
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    flat = {
        "data.path": str(corpus), "data.cache_dir": str(tmp / "cache"), "data.val_fraction": "0.05",
        "train.steps": "6", "train.global_batch": "8", "train.micro_batch": "2", "train.seq_len": "16",
        "optim.lr": "3e-3", "optim.warmup_steps": "2", "train.val_every": "0", "compute.device": "cpu",
        "log.every": "1", "log.progress": "false", "checkpoint.every": "0", "checkpoint.keep": "3",
    }
    flat.update({f"model.{k}": str(v) for k, v in TINY_MODEL.items()})
    flat.update({k: str(v) for k, v in overrides.items()})
    return build_config({}, flat)


def train_on_rank(rank: int, world: int, tmp: str, overrides: dict, run: str) -> None:
    """A per-rank target (tests' `run_ranks`): every rank trains the tiny config with `overrides` into tmp/run."""
    train(tiny_config(Path(tmp), **overrides), Path(tmp) / run)


def losses(run_dir: Path) -> list[float]:
    """The training loss of every logged step, in order."""
    return [r["loss"] for r in read_metrics(Path(run_dir)) if "loss" in r]


def grad_norms(run_dir: Path) -> list[float]:
    """The global gradient norm (before clipping) of every logged step, in order."""
    return [r["grad_norm"] for r in read_metrics(Path(run_dir)) if "loss" in r]


def final_weights(run_dir: Path) -> dict:
    """Every model tensor (whole) of the newest complete checkpoint, whatever layout wrote it."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint")
    return read_model_tensors(ckpt)[1]
