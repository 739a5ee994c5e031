"""Resharding: a checkpoint saved at step 2 under one layout resumes under another (other world sizes too) and
continues exactly like the single-process run that never stopped: losses of steps 1-4 and final weights within
the layout parity tolerance (float64, gloo). Pairs cover every dimension on each side: one process, FSDP,
ZeRO-1, HSDP, DDP, tensor and sequence parallel, context parallel, pipeline and virtual pipeline stages.
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


def _save(tmp: Path, name: str) -> Path:
    """Train layout `name` for SAVED_AT steps into tmp/save-<name>; its checkpoint."""
    Trainer(_cfg(tmp, _layout(name)[1], **{"checkpoint.every": SAVED_AT}), tmp / f"save-{name}").run(until=SAVED_AT)
    return tmp / f"save-{name}" / "checkpoints" / f"step_{SAVED_AT}"


def _resume(tmp: Path, name: str, ckpt: Path, run: str) -> None:
    train(_cfg(tmp, _layout(name)[1]), tmp / run, resume=str(ckpt))


def _save_on_rank(rank: int, world: int, tmp: str, name: str) -> None:
    _save(Path(tmp), name)


def _resume_on_rank(rank: int, world: int, tmp: str, name: str, ckpt: str, run: str) -> None:
    _resume(Path(tmp), name, Path(ckpt), run)


def _save_then_resume_on_rank(rank: int, world: int, tmp: str, saver: str, loader: str, run: str) -> None:
    _resume(Path(tmp), loader, _save(Path(tmp), saver), run)


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


PAIRS = [
    pytest.param("single", "fsdp2", id="single->fsdp2"),
    pytest.param("tp2-sp", "pp2-1f1b", id="tp2-sp->pp2"),
    pytest.param("pp2-vpp2", "single", id="pp2-vpp2->single"),
    pytest.param("cp2", "single", id="cp2->single"),
    pytest.param("fsdp2", "cp2-allgather", id="fsdp2->cp2"),
    pytest.param("zero1-2", "fsdp4", id="zero1-2->fsdp4", marks=pytest.mark.slow),
    pytest.param("hsdp-2x2", "dp2", id="hsdp-2x2->dp2", marks=pytest.mark.slow),
    pytest.param("pp2-fsdp2", "tp2-sp", id="pp2-fsdp2->tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("saver,loader", PAIRS)
def test_checkpoint_reshards_and_training_continues_exactly(saver, loader, reference, monkeypatch):
    tmp, ref_losses, ref_weights = reference
    run = f"{saver}-to-{loader}"
    (save_ranks, _), (load_ranks, _) = _layout(saver), _layout(loader)
    ckpt = tmp / f"save-{saver}" / "checkpoints" / f"step_{SAVED_AT}"
    if save_ranks == load_ranks and save_ranks > 1:
        run_ranks(_save_then_resume_on_rank, save_ranks, args=(str(tmp), saver, loader, run))
    else:
        if save_ranks == 1:
            _save(tmp, saver)
        else:
            run_ranks(_save_on_rank, save_ranks, args=(str(tmp), saver))
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
