"""Resharding: a checkpoint saved at step 2 under one layout resumes under another (other world sizes too) and
continues exactly like the single-process run that never stopped: losses of steps 1-4 and final weights within
the layout parity tolerance (float64, gloo). Pairs cover every dimension on each side: one process, FSDP,
ZeRO-1, HSDP, DDP, tensor and sequence parallel, context parallel, pipeline and virtual pipeline stages; two
pairs save in the background (checkpoint.async_save), whose DTensor shards are staged in host memory.
Where the loading side is one process, the resume runs with every unpickling entry point made to raise.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from fourfold.testing import LAYOUTS, PARITY_TOLERANCE
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import Trainer, train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import final_weights, tiny_config

STEPS = 4
SAVED_AT = 2


def _cfg(tmp: Path, overrides: dict, **extra):
    return tiny_config(tmp, **{"compute.precision": "fp64", "train.steps": STEPS, **overrides, **extra})


def _layout(name: str) -> tuple[int, dict]:
    return (1, {}) if name == "single" else (LAYOUTS[name].ranks, LAYOUTS[name].overrides)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _save(tmp: Path, name: str, background: bool = False) -> Path:
    """Train layout `name` for SAVED_AT steps into tmp/save-<name> (saving in the background or not); its
    checkpoint."""
    extra = {"checkpoint.every": SAVED_AT, "checkpoint.async_save": background}
    Trainer(_cfg(tmp, _layout(name)[1], **extra), tmp / f"save-{name}").run(until=SAVED_AT)
    return tmp / f"save-{name}" / "checkpoints" / f"step_{SAVED_AT}"


def _resume(tmp: Path, name: str, ckpt: Path, run: str) -> None:
    train(_cfg(tmp, _layout(name)[1]), tmp / run, resume=str(ckpt))


def _save_on_rank(rank: int, world: int, tmp: str, name: str, background: bool) -> None:
    _save(Path(tmp), name, background)


def _resume_on_rank(rank: int, world: int, tmp: str, name: str, ckpt: str, run: str) -> None:
    _resume(Path(tmp), name, Path(ckpt), run)


def _save_then_resume_on_rank(rank: int, world: int, tmp: str, saver: str, loader: str, run: str,
                              background: bool) -> None:
    _resume(Path(tmp), loader, _save(Path(tmp), saver, background), run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, STEPS steps, never stopped: losses by step and final weights."""
    tmp = tmp_path_factory.mktemp("reshard")
    train(_cfg(tmp, {}), tmp / "straight")
    return tmp, _losses(tmp / "straight"), final_weights(tmp / "straight")


def _refuse_unpickling(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint loading unpickled something")

    for target, attr in ((torch, "load"), (torch.serialization, "load"), (pickle, "load"), (pickle, "loads"),
                         (pickle, "Unpickler")):
        monkeypatch.setattr(target, attr, refuse)


# (save layout, load layout, whether the save runs in the background: checkpoint.async_save)
PAIRS = [
    pytest.param("single", "fsdp2", False, id="single->fsdp2"),
    pytest.param("tp2-sp", "pp2-1f1b", False, id="tp2-sp->pp2"),
    pytest.param("pp2-vpp2", "single", False, id="pp2-vpp2->single"),
    pytest.param("cp2", "single", False, id="cp2->single"),
    pytest.param("fsdp2", "cp2-allgather", True, id="fsdp2-async->cp2"),
    pytest.param("zero1-2", "fsdp4", False, id="zero1-2->fsdp4", marks=pytest.mark.slow),
    pytest.param("hsdp-2x2", "dp2", True, id="hsdp-2x2-async->dp2", marks=pytest.mark.slow),
    pytest.param("pp2-fsdp2", "tp2-sp", False, id="pp2-fsdp2->tp2", marks=pytest.mark.slow),
    pytest.param("tp2-fsdp2", "zero2-2", False, id="tp2-fsdp2->zero2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("saver,loader,background", PAIRS)
def test_checkpoint_reshards_and_training_continues_exactly(saver, loader, background, reference, monkeypatch):
    tmp, ref_losses, ref_weights = reference
    run = f"{saver}-to-{loader}"
    (save_ranks, _), (load_ranks, _) = _layout(saver), _layout(loader)
    ckpt = tmp / f"save-{saver}" / "checkpoints" / f"step_{SAVED_AT}"
    if save_ranks == load_ranks and save_ranks > 1:
        run_ranks(_save_then_resume_on_rank, save_ranks, args=(str(tmp), saver, loader, run, background))
    else:
        if save_ranks == 1:
            _save(tmp, saver, background)
        else:
            run_ranks(_save_on_rank, save_ranks, args=(str(tmp), saver, background))
        if load_ranks == 1:
            with monkeypatch.context() as m:
                _refuse_unpickling(m)
                _resume(tmp, loader, ckpt, run)
        else:
            run_ranks(_resume_on_rank, load_ranks, args=(str(tmp), loader, str(ckpt), run))
    first, continued = _losses(tmp / f"save-{saver}"), _losses(tmp / run)
    assert sorted(first) == [1, 2] and sorted(continued) == [3, 4]
    got = [first[1], first[2], continued[3], continued[4]]
    rtol, atol = PARITY_TOLERANCE["loss"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor([ref_losses[s] for s in range(1, STEPS + 1)]),
                               rtol=rtol, atol=atol)
    weights = final_weights(tmp / run)
    assert weights.keys() == ref_weights.keys()
    rtol, atol = PARITY_TOLERANCE["weight"]
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
