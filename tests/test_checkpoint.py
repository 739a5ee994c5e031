"""Checkpoints: atomic saves survive a crash, keep-K retention, pickle-free loading, clear errors on damaged
files (checked against the COMPLETE marker's sizes and sha256 before anything loads), fallback to the
previous checkpoint, the audit's resume checks (meta.json entries, changed data settings), asynchronous
saves, and resharding: a checkpoint written under fsdp=2 resumes under tp=2 and in one process, one written
under ZeRO-1 resumes under ZeRO-1 and FSDP, with the continued losses and final weights of a run that never
stopped (float64, gloo). More layout pairs: tests/distributed/test_reshard.py.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from fourfold.cli import main
from fourfold.errors import CheckpointError
from fourfold.models.llama import Llama
from fourfold.checkpoint import store as ckpt_mod
from fourfold.checkpoint.safetensors_io import SequentialSafetensorsWriter
from fourfold.checkpoint.store import latest_checkpoint, list_checkpoints, resolve_resume
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import Trainer, train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import final_weights, losses, tiny_config

STEPS = 4


def _cfg(tmp: Path, **extra):
    return tiny_config(tmp, **{"compute.precision": "fp64", "train.steps": STEPS, **extra})


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last record winning (a crashed run and its resumption both log some steps)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _assert_same_weights(got: dict, ref: dict, exact: bool) -> None:
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        if exact:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-8, atol=1e-10, msg=lambda m: f"{key}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A single-process float64 run of STEPS steps that never stops: its losses and final weights."""
    tmp = tmp_path_factory.mktemp("ckpt-ref")
    train(_cfg(tmp), tmp / "straight")
    return tmp, _losses_by_step(tmp / "straight"), final_weights(tmp / "straight")


# ----- atomic saves ------------------------------------------------------------------------------

def _crash_in_second_save(monkeypatch, where: str) -> None:
    """Make the step-4 save fail: while writing its shard file (half written), or at the final rename, after
    every file and the marker are written."""
    if where == "write":
        real = SequentialSafetensorsWriter.write

        def write(self, name, tensor):
            if ".tmp-step_4" in str(self.path) and name.startswith("state."):
                raise OSError("simulated crash while writing the optimizer state")
            real(self, name, tensor)

        monkeypatch.setattr(SequentialSafetensorsWriter, "write", write)
    else:
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if ".tmp-step_4" in str(src):
                raise OSError("simulated crash before the rename")
            return real_rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(ckpt_mod.os, "rename", rename)


@pytest.mark.parametrize("where", ["write", "rename"])
def test_crash_mid_save_keeps_previous_checkpoint(where, tmp_path, monkeypatch, reference):
    _, ref_losses, ref_weights = reference
    cfg = _cfg(tmp_path, **{"checkpoint.every": 2, "checkpoint.keep": 1})
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _crash_in_second_save(m, where)
        with pytest.raises(OSError, match="simulated crash"):
            Trainer(cfg, run).run()
    root = run / "checkpoints"
    partial = root / ".tmp-step_4"
    assert (partial / "model-00000.safetensors").is_file()  # the crash left a half-written checkpoint ...
    assert (partial / "COMPLETE").is_file() == (where == "rename")
    assert not (root / "step_4").exists()
    # ... which neither listing nor resume picks up; step 2 survived (keep=1 never ran for step 4).
    assert list_checkpoints(run) == [root / "step_2"]
    assert resolve_resume(run, True) == root / "step_2"
    model = Llama(cfg.model).double()
    assert ckpt_mod.load_checkpoint(root / "step_2", model)["step"] == 2

    summary = train(cfg, run, resume=True)
    assert summary.steps == STEPS
    assert _losses_by_step(run) == ref_losses  # resuming from step 2 redoes steps 3-4 exactly
    _assert_same_weights(final_weights(run), ref_weights, exact=True)
    # The stale temporary was replaced; keep=1 spared step_2, the checkpoint this run resumed from.
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]


def test_incomplete_directories_are_never_resumed(tmp_path):
    run = tmp_path / "run"
    train(_cfg(tmp_path, **{"train.steps": 2, "checkpoint.every": 1}), run)
    root = run / "checkpoints"
    shutil.copytree(root / "step_2", root / "step_9")
    (root / "step_9" / "COMPLETE").unlink()  # a directory that looks newer but was never completed
    (root / "step_x").mkdir()
    assert latest_checkpoint(run) == root / "step_2"
    assert [p.name for p in list_checkpoints(run)] == ["step_1", "step_2"]
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(tmp_path / "empty", str(tmp_path / "empty"))


def test_keep_k_retention(tmp_path):
    run = tmp_path / "run"
    train(_cfg(tmp_path, **{"train.steps": 5, "checkpoint.every": 1, "checkpoint.keep": 2}), run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_5"]
    train(_cfg(tmp_path, **{"train.steps": 3, "checkpoint.every": 1, "checkpoint.keep": 0}), tmp_path / "all")
    assert [p.name for p in list_checkpoints(tmp_path / "all")] == ["step_1", "step_2", "step_3"]


# ----- no pickle ---------------------------------------------------------------------------------

def test_checkpoint_holds_only_safetensors_and_json_and_loads_without_unpickling(tmp_path, monkeypatch, reference):
    _, ref_losses, ref_weights = reference
    run = tmp_path / "run"
    cfg = _cfg(tmp_path, **{"checkpoint.every": 2})
    Trainer(cfg, run).run(until=2)
    ckpt = run / "checkpoints" / "step_2"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["COMPLETE", "meta.json", "metadata.json", "model-00000.safetensors", "optim-00000.safetensors",
                     "optim.json"]

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint loading unpickled something")

    for target, name in ((torch, "load"), (torch.serialization, "load"), (pickle, "load"), (pickle, "loads"),
                         (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, refuse)
    train(cfg, run, resume=True)
    monkeypatch.undo()
    assert _losses_by_step(run) == ref_losses
    _assert_same_weights(final_weights(run), ref_weights, exact=True)


# ----- damaged files -----------------------------------------------------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def _garble_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 16 + data[16:])


def _remove(path: Path) -> None:
    path.unlink()


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10  # in the tensor data: the file still parses, only the checksum notices
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated-shard": ("model-00000.safetensors", _truncate),
    "bit-flipped-shard": ("model-00000.safetensors", _flip_a_bit),
    "garbled-shard-header": ("model-00000.safetensors", _garble_header),
    "missing-shard": ("model-00000.safetensors", _remove),
    "bit-flipped-optimizer-shard": ("optim-00000.safetensors", _flip_a_bit),
    "truncated-metadata": ("metadata.json", _truncate),
    "truncated-optimizer-groups": ("optim.json", _truncate),
    "missing-optimizer-groups": ("optim.json", _remove),
    "truncated-meta": ("meta.json", _truncate),
    "missing-marker": ("COMPLETE", _remove),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt-damage")
    train(_cfg(tmp, **{"train.steps": 1}), tmp / "run")
    return tmp


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_checkpoint_gives_a_clear_error(name, saved_run, tmp_path, capsys):
    filename, damage = DAMAGE[name]
    run = tmp_path / "run"
    shutil.copytree(saved_run / "run", run)
    ckpt = run / "checkpoints" / "step_1"
    damage(ckpt / filename)
    cfg = _cfg(saved_run, **{"train.steps": 2})
    with pytest.raises(CheckpointError) as err:
        Trainer(cfg, run, resume=str(ckpt))
    assert filename in str(err.value)
    # The same through the CLI: one line naming the file, exit code 2, no traceback.
    argv = ["train", "--out", str(run), "--resume", str(ckpt), "--sample", ""]
    for key, value in (("data.path", cfg.data.path), ("data.cache_dir", cfg.data.cache_dir), ("train.steps", 2),
                       ("train.seq_len", 16), ("train.global_batch", 8), ("train.micro_batch", 2),
                       ("compute.device", "cpu"), ("log.progress", "false"), ("model.dim", 32), ("model.n_layers", 4),
                       ("model.n_heads", 4), ("model.n_kv_heads", 2), ("model.ffn_dim", 64),
                       ("model.vocab_size", 320), ("model.max_seq_len", 64), ("compute.precision", "fp64")):
        argv += [f"--{key}", str(value)]
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and filename in captured.err


# ----- resharding across layouts -----------------------------------------------------------------

def _fsdp_then_tp(rank: int, world: int, tmp: str) -> None:
    tmp = Path(tmp)
    Trainer(_cfg(tmp, **{"parallel.fsdp": 2, "checkpoint.every": 2}), tmp / "fsdp2").run(until=2)
    saved = tmp / "fsdp2" / "checkpoints" / "step_2"
    train(_cfg(tmp, **{"parallel.tp": 2}), tmp / "tp2", resume=str(saved))


def _assert_continues_reference(run_dir: Path, first: dict, ref_losses: dict, ref_weights: dict) -> None:
    """A run resumed from step 2 logs steps 3 and 4 with the uninterrupted run's losses, and ends at its weights."""
    continued = _losses_by_step(run_dir)
    assert sorted(continued) == [3, 4], run_dir.name
    got = [first[1], first[2], continued[3], continued[4]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor([ref_losses[s] for s in (1, 2, 3, 4)]),
                               rtol=1e-9, atol=1e-12, msg=lambda m: f"{run_dir.name}: {m}")
    _assert_same_weights(final_weights(run_dir), ref_weights, exact=False)


def test_fsdp_checkpoint_resumes_under_tp_and_single_process(reference):
    tmp, ref_losses, ref_weights = reference
    run_ranks(_fsdp_then_tp, 2, args=(str(tmp),))
    saved = tmp / "fsdp2" / "checkpoints" / "step_2"
    first = _losses_by_step(tmp / "fsdp2")
    assert sorted(first) == [1, 2]
    train(_cfg(tmp), tmp / "single", resume=str(saved))
    for run in ("tp2", "single"):
        _assert_continues_reference(tmp / run, first, ref_losses, ref_weights)
    assert losses(tmp / "tp2") == pytest.approx(losses(tmp / "single"), rel=1e-9)


def _zero1_then_zero1_and_fsdp(rank: int, world: int, tmp: str) -> None:
    tmp = Path(tmp)
    zero1 = {"parallel.fsdp": 2, "parallel.zero": 1}
    Trainer(_cfg(tmp, **zero1, **{"checkpoint.every": 2}), tmp / "zero1").run(until=2)
    saved = tmp / "zero1" / "checkpoints" / "step_2"
    train(_cfg(tmp, **zero1), tmp / "zero1-resumed", resume=str(saved))
    train(_cfg(tmp, **{"parallel.fsdp": 2}), tmp / "fsdp-from-zero1", resume=str(saved))


def test_zero1_checkpoint_resumes_under_zero1_and_fsdp(reference):
    tmp, ref_losses, ref_weights = reference
    run_ranks(_zero1_then_zero1_and_fsdp, 2, args=(str(tmp),))
    first = _losses_by_step(tmp / "zero1")
    for run in ("zero1-resumed", "fsdp-from-zero1"):
        _assert_continues_reference(tmp / run, first, ref_losses, ref_weights)


# ----- another model's checkpoint -----------------------------------------------------------------

@pytest.mark.parametrize("change,message", [({"dim": 64}, "has shape"), ({"n_layers": 5}, "has no tensor"),
                                            ({"n_layers": 3}, "model does not have")])
def test_checkpoint_of_another_shape_is_refused_before_loading(change, message, saved_run):
    ckpt = saved_run / "run" / "checkpoints" / "step_1"
    cfg = _cfg(saved_run)
    model = Llama(type(cfg.model)(**{**cfg.model.__dict__, **change})).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"metadata.json.*{message}"):
        ckpt_mod.load_checkpoint(ckpt, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded


def test_loading_weights_alone_needs_no_optimizer_file(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run / "run", run)
    ckpt = run / "checkpoints" / "step_1"
    _remove(ckpt / "optim-00000.safetensors")
    model = Llama(_cfg(saved_run).model).double()
    assert ckpt_mod.load_checkpoint(ckpt, model)["step"] == 1  # inference and init_from read the weights only
    with pytest.raises(CheckpointError, match="optim-00000.safetensors is missing"):
        ckpt_mod.load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))
