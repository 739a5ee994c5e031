"""What resuming, restarting and bad steps do in one process (issue 14's audit and fault-tolerance items):

- resuming a checkpoint at or past `--train.steps` is an error naming the checkpoint and the fix (exit 2),
  except on an automatic torchrun restart of a finished run, which ends at once;
- a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest checkpoint without --resume;
- metrics.jsonl holds each step once after a resume (redone steps and cut-short lines dropped);
- a NaN/inf step is skipped (weights and optimizer state unchanged), counted, and too many in a row stop the
  run with a message; SIGTERM checkpoints the finished step and stops (exit 143);
- the process group gets fault.timeout_s, on a store whose keys are prefixed by the attempt.
"""

from __future__ import annotations

import json
import math
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from fourfold.cli import main
from fourfold.cli.common import without as _without
from fourfold.config_text import to_toml
from fourfold.distributed import attempt_store, init_distributed
from fourfold.errors import ConfigError, TrainingError
from fourfold.train.guard import StepGuard
from fourfold.train.metrics import drop_records_after, read_metrics
from fourfold.train.restart import resume_target, work_left
from fourfold.train.trainer import Trainer, train
from tests.distributed.launcher import free_port
from tests.trainer_helpers import losses, tiny_config

STEPS = 6


def _cfg(tmp: Path, **extra):
    return tiny_config(tmp, **{"train.steps": STEPS, **extra})


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 6-step run, a checkpoint every 3 steps."""
    tmp = tmp_path_factory.mktemp("audit-ref")
    train(_cfg(tmp, **{"checkpoint.every": 3}), tmp / "straight")
    return tmp, losses(tmp / "straight")


# ----- nothing left to do -------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [2, 6])
def test_resume_at_or_past_train_steps_is_an_error(steps, reference, capsys):
    tmp, _ = reference
    ckpt = tmp / "straight" / "checkpoints" / "step_6"
    with pytest.raises(ConfigError, match=r"(?s)step_6 is at step 6 and train.steps is %d.*--train.steps greater "
                                          r"than 6" % steps):
        Trainer(_cfg(tmp, **{"train.steps": steps}), tmp / f"again{steps}", resume=str(ckpt))
    config = tmp / "cfg.toml"
    config.write_text(to_toml(_cfg(tmp, **{"train.steps": steps})))
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--out", str(tmp / "cli"), "--resume", str(ckpt),
                 "--sample", ""]) == 2
    err = capsys.readouterr().err
    assert "nothing left to train" in " ".join(err.split()) and "Traceback" not in err


def test_automatic_restart_of_a_finished_run_ends_at_once(reference, monkeypatch):
    tmp, ref = reference
    run = tmp / "finished"
    train(_cfg(tmp), run)
    before = (run / "metrics.jsonl").read_text()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = Trainer(_cfg(tmp), run)
    assert trainer.step == STEPS and trainer.finished
    summary = trainer.run()
    assert summary.losses == [] and summary.stopped_by is None
    assert (run / "metrics.jsonl").read_text() == before


def test_work_left_rules():
    assert work_left(3, 6, automatic=False, source="c")
    assert not work_left(6, 6, automatic=True, source="c")
    for step, automatic in ((6, False), (7, True), (7, False)):
        with pytest.raises(ConfigError):
            work_left(step, 6, automatic=automatic, source="c")


# ----- restarts resume on their own ---------------------------------------------------------------

def test_restart_resumes_from_the_newest_checkpoint_without_resume(reference, monkeypatch):
    tmp, ref = reference
    run = tmp / "crashed"
    Trainer(_cfg(tmp, **{"checkpoint.every": 3}), run).run(until=5)  # checkpoint 3, records 1-5, then "dies"
    assert _steps(run) == [1, 2, 3, 4, 5]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = Trainer(_cfg(tmp, **{"checkpoint.every": 3}), run)  # no resume argument
    assert trainer.step == 3
    trainer.run()
    assert _steps(run) == list(range(1, STEPS + 1))  # 4 and 5 redone, logged once
    assert losses(run) == ref  # exactly the uninterrupted run
    # Without the restart count the same call starts again from step 0 (a first attempt resumes only if asked).
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert Trainer(_cfg(tmp), tmp / "fresh").step == 0


def test_resume_target_rules(tmp_path, reference):
    tmp, _ = reference
    run = tmp / "straight"
    assert resume_target(False, run, attempt=0) is False
    assert resume_target("some/ckpt", run, attempt=0) == "some/ckpt"
    assert resume_target(False, run, attempt=2) == "latest"
    assert resume_target("some/ckpt", run, attempt=1) == "latest"  # the run has moved past the given one
    assert resume_target(False, tmp_path, attempt=1) is False  # no checkpoint yet: from step 0
    assert resume_target("some/ckpt", tmp_path, attempt=1) == "some/ckpt"


def test_training_draws_nothing_from_the_global_random_generator(tmp_path):
    """Why a checkpoint need not hold the RNG state: steps use none (no dropout; the sampler has its own
    seeded generator), so a resumed run's draws cannot differ from an uninterrupted one's."""
    trainer = Trainer(_cfg(tmp_path, **{"train.steps": 3}), tmp_path / "rng")
    before = torch.get_rng_state()
    trainer.run()
    assert torch.equal(torch.get_rng_state(), before)


# ----- metrics.jsonl: one history ----------------------------------------------------------------

def test_resumed_run_logs_each_step_once(reference):
    tmp, ref = reference
    run = tmp / "resumed"
    Trainer(_cfg(tmp, **{"checkpoint.every": 3}), run).run(until=5)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.')  # a record a crash cut short
    train(_cfg(tmp, **{"checkpoint.every": 3}), run, resume=True)
    assert _steps(run) == list(range(1, STEPS + 1))
    assert losses(run) == ref


def test_drop_records_after(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "val_loss": 2.0}, {"step": 3, "loss": 3.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    drop_records_after(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:2]
    drop_records_after(path, 0)  # a new run in the same directory starts an empty history
    assert path.read_text() == ""
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left behind
    drop_records_after(tmp_path / "absent.jsonl", 3)  # nothing to do


# ----- NaN/inf steps ------------------------------------------------------------------------------

def test_nan_step_is_skipped_and_counted(tmp_path):
    run = tmp_path / "nan"
    train(_cfg(tmp_path, **{"fault.nan_at_step": 3, "checkpoint.every": 1, "checkpoint.keep": 0}), run)
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records[2]["loss"] is None  # NaN is written as null
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    ckpts = run / "checkpoints"
    tensors = {s: {f.name: load_file(f) for f in sorted((ckpts / f"step_{s}").glob("*.safetensors"))} for s in (2, 3, 4)}
    assert {name.split("-")[0] for name in tensors[2]} == {"model", "optim"}
    for name, saved in tensors[2].items():  # step 3 changed neither the weights nor AdamW's state ...
        assert saved.keys() == tensors[3][name].keys()
        assert all(torch.equal(saved[k], tensors[3][name][k]) for k in saved), name
        # ... and step 4 trained again
        assert any(not torch.equal(tensors[3][name][k], tensors[4][name][k]) for k in saved), name
    assert json.loads((ckpts / "step_6" / "meta.json").read_text())["guard"]["skipped_steps"] == 1


def test_too_many_bad_steps_in_a_row_stop_the_run(tmp_path, capsys):
    overrides = {"fault.nan_at_step": 2, "fault.nan_steps": 5, "train.max_bad_steps": 3}
    with pytest.raises(TrainingError, match=r"3 steps in a row, up to step 4, had a NaN.*train.max_bad_steps 3"):
        train(_cfg(tmp_path, **overrides), tmp_path / "diverged")
    config = tmp_path / "cfg.toml"
    config.write_text(to_toml(_cfg(tmp_path, **overrides)))
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "cli"), "--sample", ""]) == 2
    assert "Traceback" not in capsys.readouterr().err
    # Two bad steps in a row, under the limit, do not stop it; the count restarts after a good step.
    train(_cfg(tmp_path, **{**overrides, "fault.nan_steps": 2}), tmp_path / "recovers")


def test_fault_rank_outside_the_job_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="fault.kill_rank 1 is not a rank of this 1-process job"):
        Trainer(_cfg(tmp_path, **{"fault.kill_at_step": 2, "fault.kill_rank": 1}), tmp_path / "run")


def test_guard_counts_and_restores():
    guard = StepGuard(max_bad_steps=0, device=torch.device("cpu"))
    finite, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    assert not guard.check(finite, finite, scaler_skipped=False, step=1)
    assert guard.check(finite, torch.tensor(float("inf")), scaler_skipped=False, step=2)
    assert guard.check(nan, finite, scaler_skipped=False, step=3)
    assert guard.check(finite, finite, scaler_skipped=True, step=4)  # the fp16 scaler's skip counts too
    assert guard.state_dict() == {"skipped_steps": 3, "bad_in_a_row": 3}
    restored = StepGuard(0, torch.device("cpu"))
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert not restored.check(finite, finite, False, 5) and restored.bad_in_a_row == 0


# ----- SIGTERM ------------------------------------------------------------------------------------

def _sigterm_at(trainer: Trainer, step: int) -> None:
    original = trainer.train_step

    def train_step(*args, **kwargs):
        if trainer.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    trainer.train_step = train_step


def test_sigterm_saves_a_checkpoint_and_stops(reference):
    tmp, ref = reference
    run = tmp / "preempted"
    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(_cfg(tmp), run)
    _sigterm_at(trainer, 2)
    summary = trainer.run()
    assert summary.stopped_by == signal.SIGTERM and trainer.step == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
    train(_cfg(tmp), run, resume=True)
    assert losses(run) == ref


def test_sigterm_exit_code_from_the_command_line(tmp_path, monkeypatch, capsys):
    real_init = Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        _sigterm_at(self, 3)

    monkeypatch.setattr(Trainer, "__init__", init)
    config = tmp_path / "cfg.toml"
    config.write_text(to_toml(_cfg(tmp_path)))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run"), "--sample", ""]) == 143
    assert "Stopped by signal 15 after step 3" in " ".join(capsys.readouterr().out.split())


def test_sigterm_handler_only_when_asked():
    before = signal.getsignal(signal.SIGTERM)
    off = StepGuard(0, torch.device("cpu"), catch_sigterm=False)
    off.watch_sigterm()
    assert signal.getsignal(signal.SIGTERM) is before  # fault.checkpoint_on_sigterm false: SIGTERM kills at once
    on = StepGuard(0, torch.device("cpu"), catch_sigterm=True)
    on.watch_sigterm()
    try:
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        on.unwatch_sigterm()
    assert signal.getsignal(signal.SIGTERM) is before


# ----- the process group: timeout and per-attempt store ------------------------------------------

def test_process_group_gets_the_timeout(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    for key in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    init_distributed("cpu", timeout_s=42.0)
    assert seen["timeout"] == timedelta(seconds=42) and seen["backend"] == "gloo" and "store" not in seen
    assert tiny_config(tmp_path).fault.timeout_s == 1800.0


def test_each_attempt_sees_only_its_own_keys(monkeypatch):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, multi_tenant=True)  # torchrun's shared store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    stores = {}
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        stores[attempt] = attempt_store(1, 2, timedelta(seconds=10))
    stores[0].set("rank_0", "address of a worker that has since died")
    assert agent.get("fourfold/attempt_0/rank_0") == b"address of a worker that has since died"
    assert not stores[1].check(["rank_0"])  # the restarted workers never read it
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert attempt_store(0, 2, timedelta(seconds=10)) is None  # not under torchrun: plain env://


def test_max_restarts_needs_nproc(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--max-restarts", "1"]) == 2
    assert "--max-restarts 1" in capsys.readouterr().err
    assert _without(["--nproc", "2", "--a", "1", "--max-restarts=3", "--b"], ("--nproc", "--max-restarts")) == \
        ["--a", "1", "--b"]
