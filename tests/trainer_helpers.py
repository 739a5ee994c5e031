"""Shared set-up for tests that run the real trainer: a tiny config, a small corpus, reading results."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from fourfold.config import build_config
from fourfold.train.metrics import read_metrics

TINY_MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=320, max_seq_len=64)


def write_corpus(path: Path, n_bytes: int = 40_000) -> Path:
    """A deterministic text file with some structure (so loss falls) and enough tokens for a few steps."""
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "print", "value"]
    lines, i = [], 0
    while sum(len(x) + 1 for x in lines) < n_bytes:
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 9)) + f" {i % 97}")
        i += 1
    path.write_text("\n".join(lines))
    return path


def tiny_config(tmp: Path, **overrides):
    """A config for trainer tests: tiny model, small batch, a corpus in `tmp`, no progress bar."""
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
    """A `run_ranks` target: every rank trains the tiny config with `overrides` into tmp/run."""
    from fourfold.train.trainer import train

    train(tiny_config(Path(tmp), **overrides), Path(tmp) / run)


def losses(run_dir: Path) -> list[float]:
    """The training loss of every logged step, in order."""
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def grad_norms(run_dir: Path) -> list[float]:
    """The global gradient norm (before clipping) of every logged step, in order."""
    return [r["grad_norm"] for r in read_metrics(run_dir) if "loss" in r]


def final_weights(run_dir: Path) -> dict:
    """Every model tensor of the newest checkpoint, merged over pipeline-stage files."""
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    out = {}
    for f in sorted(ckpts[-1].glob("model-*.safetensors")):
        out.update(load_file(str(f)))
    return out
