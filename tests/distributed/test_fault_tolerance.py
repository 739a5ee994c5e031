"""Fault tolerance on gloo ranks: a job that loses a rank restarts and finishes as if nothing happened.

(a) `fourfold train --nproc 2 --max-restarts 1` (DDP) and plain `torchrun --max-restarts 1 -m fourfold train`
    on 4 ranks (FSDP 2 x TP 2), with fault injection killing rank 1 (SIGKILL) as step 7 of 12 starts and a
    checkpoint every 4 steps: the job exits 0, the restart resumes from step 4 on its own (no --resume),
    metrics.jsonl holds steps 1-12 once each, and losses and final weights equal an uninterrupted run's
    exactly.
(b) A NaN loss on rank 1 only: every rank skips that step, and the run matches one process whose loss was
    NaN at the same step.
(c) SIGTERM to rank 1 only: both ranks stop after the same step with one checkpoint; resuming finishes with
    the uninterrupted run's losses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fourfold.config_text import to_toml
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import Trainer, train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import final_weights, losses, tiny_config, train_on_rank

STEPS = 12
REPO = Path(__file__).resolve().parents[2]
KILL = ["--fault.kill_at_step", "7", "--fault.kill_rank", "1", "--sample", ""]


def _overrides(**layout) -> dict:
    return {"train.steps": STEPS, "checkpoint.every": 4, **layout}


def _cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _assert_restarted_like_reference(out: subprocess.CompletedProcess, run: Path, reference: Path) -> None:
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 0, text[-3000:]
    assert "[fault] killing rank 1 at step 7" in text
    assert "Restart 1 (torchrun): continuing from the newest checkpoint, step 4." in text
    assert "connectFullMesh" not in text
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, STEPS + 1))
    assert losses(run) == losses(reference)  # exactly: same layout, same arithmetic
    want, got = final_weights(reference), final_weights(run)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_ranks_lose_rank_one_and_finish_with_fourfold_max_restarts(tmp_path):
    layout = _overrides(**{"parallel.dp": 2})
    run_ranks(train_on_rank, 2, args=(str(tmp_path), layout, "reference"))
    config = tmp_path / "job.toml"
    config.write_text(to_toml(tiny_config(tmp_path, **layout)))
    out = _cli(["-m", "fourfold", "train", "--nproc", "2", "--max-restarts", "1", "--config", str(config),
                "--out", str(tmp_path / "job"), *KILL])
    _assert_restarted_like_reference(out, tmp_path / "job", tmp_path / "reference")


@pytest.mark.slow
def test_four_ranks_lose_rank_one_and_finish_under_plain_torchrun(tmp_path):
    layout = _overrides(**{"parallel.fsdp": 2, "parallel.tp": 2})
    run_ranks(train_on_rank, 4, args=(str(tmp_path), layout, "reference"))
    config = tmp_path / "job.toml"
    config.write_text(to_toml(tiny_config(tmp_path, **layout)))
    out = _cli(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "1",
                "-m", "fourfold", "train", "--config", str(config), "--out", str(tmp_path / "job"), *KILL])
    _assert_restarted_like_reference(out, tmp_path / "job", tmp_path / "reference")


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    steps = {"train.steps": 5, "fault.nan_at_step": 3}
    train(tiny_config(tmp_path, **steps), tmp_path / "single")
    run_ranks(train_on_rank, 2, args=(str(tmp_path), {**steps, "parallel.dp": 2, "fault.nan_rank": 1}, "dp2"))
    for run in ("single", "dp2"):
        records = [r for r in read_metrics(tmp_path / run) if "loss" in r]
        assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1], run
        assert records[2]["loss"] is None, run
    got, want = losses(tmp_path / "dp2"), losses(tmp_path / "single")
    assert got[2] is None and want[2] is None
    torch.testing.assert_close(torch.tensor(got[:2] + got[3:]), torch.tensor(want[:2] + want[3:]), rtol=1e-5, atol=0)


def _sigterm_rank_one_at_step_three(rank: int, world: int, tmp: str) -> tuple:
    trainer = Trainer(tiny_config(Path(tmp), **{"parallel.dp": 2}), Path(tmp) / "preempted")
    original = trainer.train_step

    def train_step(*args, **kwargs):
        if rank == 1 and trainer.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    trainer.train_step = train_step
    return trainer.run().stopped_by, trainer.step


def _resume(rank: int, world: int, tmp: str) -> None:
    train(tiny_config(Path(tmp), **{"parallel.dp": 2}), Path(tmp) / "preempted", resume=True)


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_and_stops_every_rank(tmp_path):
    run_ranks(train_on_rank, 2, args=(str(tmp_path), {"parallel.dp": 2}, "reference"))
    results = run_ranks(_sigterm_rank_one_at_step_three, 2, args=(str(tmp_path),))
    assert results == [(signal.SIGTERM, 3), (signal.SIGTERM, 3)]
    assert sorted(p.name for p in (tmp_path / "preempted" / "checkpoints").iterdir()) == ["step_3"]
    run_ranks(_resume, 2, args=(str(tmp_path),))
    assert losses(tmp_path / "preempted") == losses(tmp_path / "reference")
