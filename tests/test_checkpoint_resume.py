"""Resuming safely: fallback past a damaged newest checkpoint (naming both), keep-K sparing the checkpoint a run
resumed from, the audit's checks (meta.json without step or data, changed global batch / sequence length /
data), asynchronous saves that continue exactly like synchronous ones, and `checkpoint.init_from` (weights
and model shape from a checkpoint, optimizer and step fresh; a conflicting explicit [model] key refused).
"""

from __future__ import annotations

import io
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fourfold.checkpoint import async_save
from fourfold.checkpoint.consolidated import read_model_tensors
from fourfold.checkpoint.init_from import config_with_init_model
from fourfold.checkpoint.manifest import write_manifest
from fourfold.checkpoint.state import model_tensors
from fourfold.config import build_config
from fourfold.errors import CheckpointError, ConfigError
from fourfold.models.init import local_part
from fourfold.models.llama import Llama
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import Trainer, train
from tests.trainer_helpers import final_weights, tiny_config

STEPS = 4


def _cfg(tmp: Path, **extra):
    return tiny_config(tmp, **{"compute.precision": "fp64", "train.steps": STEPS, **extra})


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A run of STEPS steps saving every step (keep all): its directory and losses."""
    tmp = tmp_path_factory.mktemp("resume-ref")
    train(_cfg(tmp, **{"checkpoint.every": 1, "checkpoint.keep": 0}), tmp / "straight")
    return tmp, _losses(tmp / "straight")


def _copy_run(reference, tmp_path: Path, keep_steps: tuple[int, ...]) -> Path:
    tmp, _ = reference
    run = tmp_path / "run"
    shutil.copytree(tmp / "straight", run)
    for ckpt in (run / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) not in keep_steps:
            shutil.rmtree(ckpt)
    (run / "metrics.jsonl").unlink(missing_ok=True)
    return run


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
    tmp, ref_losses = reference
    run = _copy_run(reference, tmp_path, (1, 2))
    _flip_a_bit(run / "checkpoints" / "step_2" / "model-00000.safetensors")
    shutil.copytree(run / "checkpoints" / "step_1", run / "checkpoints" / ".tmp-step_3")  # an unfinished save
    (run / "checkpoints" / ".tmp-step_3" / "COMPLETE").unlink()
    out = io.StringIO()
    trainer = Trainer(_cfg(tmp, **{"checkpoint.every": 1, "checkpoint.keep": 1}), run, resume=True,
                      console=Console(file=out, width=400))
    log = out.getvalue()
    assert "sha256" in log and "model-00000.safetensors" in log
    assert f"{run / 'checkpoints' / 'step_2'} could not be loaded; resumed from the previous complete checkpoint " \
           f"{run / 'checkpoints' / 'step_1'}" in log
    assert "Skipping incomplete checkpoints" in log and ".tmp-step_3" in log
    assert trainer.step == 1
    trainer.run()
    assert {s: _losses(run)[s] for s in (2, 3, 4)} == {s: ref_losses[s] for s in (2, 3, 4)}
    # keep=1 deleted the damaged step_2 (replaced by a good one) but spared step_1, which this run resumed from.
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_1", "step_4"]


def test_explicit_damaged_checkpoint_is_refused_not_substituted(reference, tmp_path):
    tmp, _ = reference
    run = _copy_run(reference, tmp_path, (1, 2))
    _flip_a_bit(run / "checkpoints" / "step_2" / "model-00000.safetensors")
    with pytest.raises(CheckpointError, match="step_2.*sha256"):
        Trainer(_cfg(tmp), run, resume=str(run / "checkpoints" / "step_2"))


@pytest.mark.parametrize("key", ["step", "data"])
def test_meta_without_step_or_data_is_a_checkpoint_error(reference, tmp_path, key):
    tmp, _ = reference
    run = _copy_run(reference, tmp_path, (2,))
    ckpt = run / "checkpoints" / "step_2"
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta[key]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    write_manifest(ckpt, 2, {})  # a consistent checkpoint whose meta.json simply lacks the entry
    with pytest.raises(CheckpointError, match=f"meta.json.*'{key}'"):
        Trainer(_cfg(tmp), run, resume=str(ckpt))


@pytest.mark.parametrize("change", [{"train.global_batch": 16}, {"train.seq_len": 12}, {"data.path": "other"}])
def test_changed_data_settings_refuse_the_saved_position(reference, tmp_path, change):
    tmp, _ = reference
    run = _copy_run(reference, tmp_path, (2,))
    extra = dict(change)
    if "data.path" in extra:
        other = tmp_path / "other.txt"
        shutil.copy(tmp / "corpus.txt", other)
        other.write_text(other.read_text()[: len(other.read_text()) * 2 // 3])  # fewer sequences
        extra = {"data.path": str(other), "data.cache_dir": str(tmp_path / "cache")}
    key = next(iter(change)).split(".")[1].replace("path", "data_path")
    with pytest.raises(CheckpointError, match=f"different data settings.*{key}.*init_from"):
        Trainer(_cfg(tmp, **extra), run, resume=True)


def test_async_save_continues_exactly_and_logs_the_stall(reference, tmp_path):
    tmp, ref_losses = reference
    run = tmp_path / "async"
    cfg = _cfg(tmp, **{"checkpoint.every": 2, "checkpoint.async_save": True})
    Trainer(cfg, run).run(until=2)
    records = read_metrics(run)
    assert any("ckpt_stall_s" in r and r["step"] == 2 for r in records)
    assert any("ckpt_save_s" in r and r["step"] == 2 for r in records)  # waited for at the end of training
    ckpt = run / "checkpoints" / "step_2"
    _, saved = read_model_tensors(ckpt)
    _, sync_saved = read_model_tensors(tmp / "straight" / "checkpoints" / "step_2")
    assert saved.keys() == sync_saved.keys() and all(torch.equal(saved[k], sync_saved[k]) for k in saved)
    train(cfg, run, resume=True)
    assert _losses(run) == ref_losses
    ref_weights = final_weights(tmp / "straight")
    assert all(torch.equal(final_weights(run)[k], v) for k, v in ref_weights.items())


def test_init_from_takes_weights_and_shape_but_not_optimizer_or_step(reference, tmp_path):
    tmp, _ = reference
    source = tmp / "straight" / "checkpoints" / "step_3"
    # Model keys left at their defaults take the checkpoint's shape.
    bare = build_config({}, {"checkpoint.init_from": str(source)})
    assert bare.model.dim == 128 and config_with_init_model(bare).model.dim == 32
    cfg = _cfg(tmp, **{"checkpoint.init_from": str(tmp / "straight"), "train.steps": 1})
    trainer = Trainer(cfg, tmp_path / "init")
    _, saved = read_model_tensors(tmp / "straight")  # the run's newest checkpoint: step 4
    got = {k: local_part(v) for k, v in model_tensors(trainer.runner.checkpoint_modules).items()}
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert trainer.step == 0 and not trainer.optimizer.state
    with pytest.raises(ConfigError, match="model.dim = 64.*has 32"):
        Trainer(_cfg(tmp, **{"checkpoint.init_from": str(source), "model.dim": 64}), tmp_path / "bad")


def test_async_save_writes_the_state_of_its_step_while_training_changes_it(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    model = Llama(cfg.model).double()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    release = threading.Event()
    real = async_save.write_checkpoint

    def held_back(*args):
        release.wait(timeout=30)
        return real(*args)

    monkeypatch.setattr(async_save, "write_checkpoint", held_back)
    saver = async_save.AsyncSaver()
    saver.save(tmp_path / "run", 1, model, optimizer, {"config": cfg.to_dict()}, keep=0)
    with torch.no_grad():  # training goes on while the background thread has not written anything yet
        for p in model.parameters():
            p.add_(1.0)
    release.set()
    saver.close()
    _, saved = read_model_tensors(tmp_path / "run")
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)
