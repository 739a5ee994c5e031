"""The single-process trainer end to end: loss falls, metrics are written, resume is exact, errors are clear."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fourfold.cli import main
from fourfold.train.trainer import Trainer, train
from tests.trainer_helpers import final_weights, losses, tiny_config


def test_loss_falls_and_metrics_are_recorded(tmp_path):
    cfg = tiny_config(tmp_path, **{"train.steps": "30", "train.val_every": "15", "optim.lr": "1e-2"})
    summary = train(cfg, tmp_path / "run")
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 30
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes"):
        assert key in steps[0]
    assert steps[0]["tokens_per_s"] > 0 and steps[0]["peak_mem_bytes"] > 0
    assert any("val_loss" in r for r in records)
    assert summary.last_loss < summary.first_loss - 1.0
    assert (tmp_path / "run" / "config.toml").is_file()


def test_resume_is_exact(tmp_path):
    straight = tiny_config(tmp_path, **{"train.steps": "8", "checkpoint.every": "4"})
    train(straight, tmp_path / "a")
    # The same run interrupted after its step-4 checkpoint, then resumed to step 8.
    Trainer(straight, tmp_path / "b").run(until=4)
    resumed = tiny_config(tmp_path, **{"train.steps": "8", "checkpoint.every": "4"})
    train(resumed, tmp_path / "b", resume=True)
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    assert main(["train", "--train.stepz", "3"]) == 2
    assert "Did you mean 'train.steps'" in capsys.readouterr().err
    assert main(["train", "--parallel.tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "uses 2 ranks but 1 were started" in err
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    assert "No checkpoint found" in capsys.readouterr().err


def test_corrupt_checkpoint_is_reported(tmp_path, capsys):
    cfg = tiny_config(tmp_path, **{"train.steps": "2"})
    train(cfg, tmp_path / "run")
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    weights = next(ckpt.glob("model-*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert weights.name in err and "Traceback" not in err


@pytest.mark.slow
def test_python_dash_m_entry_point_trains_and_samples(tmp_path):
    cfg_args = ["--train.steps", "3", "--train.seq_len", "16", "--train.global_batch", "4", "--train.micro_batch", "4",
                "--data.max_bytes", "200000", "--data.cache_dir", str(tmp_path / "cache"), "--log.progress", "false"]
    out = subprocess.run([sys.executable, "-m", "fourfold", "train", "--out", str(tmp_path / "run"), *cfg_args],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    assert "done" in out.stdout and "sample" in out.stdout


def test_run_reports_what_recompute_saves_and_costs(tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    train(tiny_config(tmp_path, **{"train.steps": "1", "compute.recompute": "full"}), tmp_path / "run", console=console)
    text = console.export_text()
    assert "recompute full: activations" in text and "saves" in text and "model FLOPs per step" in text
